"""The run log's format (``run_log``), the packing log's settings and the figures it derives (``packing_log``);
the figures in Megatron-Bridge's real loop: tests/bridge/test_packing_logs.py."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from megatron.bridge_thd.packing_log import _scalars, clear_placements, figure_names, packing_log_wanted
from megatron.bridge_thd.run_log import FORMAT_VERSION, RunLogRecord, read_run_log
from megatron.bridge_thd.settings import PackingSettings


def _record(**changes) -> RunLogRecord:
    values = dict(iteration=3, iteration_time_s=0.25, layout="thd", tp=2, cp=1, pp=1, ep=1, dp=4, micro_batch_size=1,
                  micro_batches_per_step=8, global_batch_size=32, seq_length=4096, token_slots=100_000,
                  real_tokens=98_000, supervised_tokens=40_000, attention_work=2_000_000_000, padded_slots=131_072,
                  truncated_tokens=0, vision_patches=12_000, rank_cost_max_over_mean=1.02,
                  cp_per_sample_rows={"1": 30, "2": 2})
    return RunLogRecord(**{**values, **changes})


def test_a_record_round_trips_through_one_json_line(tmp_path):
    records = [_record(), _record(iteration=4, iteration_time_s=None, rank_cost_max_over_mean=None,
                       cp_per_sample_rows=None)]
    path = tmp_path / "run.jsonl"
    path.write_text("".join(r.to_json() + "\n" for r in records) + "\n")
    assert read_run_log(path) == records
    line = json.loads(records[0].to_json())
    assert line["version"] == FORMAT_VERSION and "\n" not in records[0].to_json()
    # The documented names, in order: the planner's fit reads these.
    assert list(line) == [f.name for f in dataclasses.fields(RunLogRecord)]


def test_a_newer_writers_extra_field_is_ignored_and_a_missing_one_is_named(tmp_path):
    line = json.loads(_record().to_json())
    assert RunLogRecord.from_json(json.dumps({**line, "new_figure": 1})) == _record()
    del line["real_tokens"]
    path = tmp_path / "run.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=r"run.jsonl:1: .*lacks a field.*real_tokens"):
        read_run_log(path)
    with pytest.raises(ValueError, match="format version 99"):
        RunLogRecord.from_json(json.dumps({**json.loads(_record().to_json()), "version": 99}))
    with pytest.raises(ValueError, match="not JSON"):
        RunLogRecord.from_json("{")


def test_a_version_1_line_is_read_with_its_cp_rows_as_cp_per_sample_rows():
    line = json.loads(_record().to_json())
    old = {**{k: v for k, v in line.items() if k != "cp_per_sample_rows"}, "version": 1, "cp_rows": {"4": 3}}
    assert "cp_rows" not in line and FORMAT_VERSION == 2
    assert RunLogRecord.from_json(json.dumps(old)) == _record(cp_per_sample_rows={"4": 3}, version=1)


def test_the_settings_refuse_what_they_cannot_use_naming_it(tmp_path):
    assert PackingSettings().packing_log is True and PackingSettings().run_log is None
    with pytest.raises(ValueError, match=r"packing_log: 'no'; expected True .* or False"):
        PackingSettings(packing_log="no")
    with pytest.raises(ValueError, match="run_log: .* is a directory; expected a file path"):
        PackingSettings(run_log=str(tmp_path))
    with pytest.raises(ValueError, match="run_log: 3; expected None"):
        PackingSettings(run_log=3)


def _cfg(settings=None, tensorboard_dir=None):
    dataset = SimpleNamespace(bridge_thd=settings)
    return SimpleNamespace(dataset=dataset, logger=SimpleNamespace(tensorboard_dir=tensorboard_dir))


def test_on_with_a_logger_off_with_the_setting_and_without_our_settings(tmp_path):
    assert packing_log_wanted(_cfg(PackingSettings(), tensorboard_dir="tb"))
    assert not packing_log_wanted(_cfg(PackingSettings()))  # no logger, no run log
    assert not packing_log_wanted(_cfg(PackingSettings(packing_log=False), tensorboard_dir="tb"))
    assert packing_log_wanted(_cfg(PackingSettings(packing_log=False, run_log=str(tmp_path / "r.jsonl"))))
    assert not packing_log_wanted(_cfg(None, tensorboard_dir="tb"))  # configure was not called: not our step


def test_the_interval_figures_are_per_iteration_means():
    clear_placements()
    rows = [dict(iteration=i, real_tokens=r, supervised_tokens=r // 2, attention_work=0, truncated_tokens=0,
                 vision_patches=0, token_slots=1000, padded_slots=2000, micro_batches=4, truncated_samples=1,
                 dropped_samples=0, cp_per_sample_rows={"2": 1})
            for i, r in ((1, 900), (2, 700))]
    figures = _scalars(rows, seconds=4.0, world=8)
    assert figures["packing/real_tokens_per_iteration"] == 800
    assert figures["packing/padding_share"] == pytest.approx(0.2)
    assert figures["packing/iteration_time"] == 2.0
    assert figures["packing/real_tokens_per_second"] == 400
    assert figures["packing/token_slots_per_second_per_gpu"] == 1000 / 2 / 8
    assert figures["packing/cp_per_sample_rows_2"] == 1 and figures["packing/truncated_samples_per_iteration"] == 1
    assert "packing/rank_cost_max_over_mean" not in figures
    assert set(figures) <= set(figure_names())


def test_over_long_samples_are_counted_from_the_collates_measures_and_summed():
    """The collate's lengths before its cut (overlong.LENGTHS_KEY rows): a sample longer than seq_length that the
    policy kept is truncated, one it dropped is dropped (whatever its length); a batch on a device is not read."""
    import torch

    from megatron.bridge_thd.overlong import DROPPED, MEASURES, TOKENS
    from megatron.bridge_thd.packing_log import PackingTotals
    from megatron.bridge_thd.step.prepare import overlong_sample_counts

    measures = torch.zeros(len(MEASURES), 4, dtype=torch.int64)
    measures[TOKENS] = torch.tensor([600, 400, 700, 512])  # seq_length 512: rows 0 and 2 over it, row 3 exactly at it
    measures[DROPPED, 2] = 1  # row 2 dropped from the loss
    plan = SimpleNamespace(seq_length=512)
    assert overlong_sample_counts(measures, plan) == (1, 1)
    assert overlong_sample_counts(None, plan) == (0, 0)
    totals = PackingTotals()
    for counts in ((1, 1), (2, 0)):
        stats = SimpleNamespace(real_tokens=torch.tensor(10), attention_work=torch.tensor(100),
                                truncated_tokens=torch.tensor(0), processed_tokens=12, padded_tokens=16,
                                truncated_samples=counts[0], dropped_samples=counts[1])
        totals.add(stats, None, {})
    totals.close_iteration(1)
    (row,) = totals.reduce()
    assert (row["truncated_samples"], row["dropped_samples"], row["micro_batches"]) == (3, 1, 2)
    assert {"packing/truncated_samples_per_iteration", "packing/dropped_samples_per_iteration"} <= set(figure_names())
