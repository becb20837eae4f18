"""tests/README.md's map of the suite is the tree's: every module of the three packages has a row naming the
tests that exercise it, every test file named exists, and every test file lives in an area folder."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("bridge_thd", "bridge_thd_cpu", "bridge_thd_testbed")
AREAS = ("unit", "model", "parallel", "bridge")


def _map() -> dict[str, list[str]]:
    text = (ROOT / "tests" / "README.md").read_text()
    rows = re.findall(r"^\| `((?:%s)/[\w/]+\.py)` \| (.+) \|$" % "|".join(PACKAGES), text, flags=re.M)
    return {module: re.findall(r"`([\w/]+\.py)`", tests) for module, tests in rows}


def test_every_module_has_a_test_home():
    modules = {path.relative_to(ROOT / "src" / "megatron").as_posix()
               for package in PACKAGES for path in (ROOT / "src" / "megatron" / package).rglob("*.py")
               if path.name != "__init__.py"}
    listed = _map()
    assert sorted(modules - set(listed)) == [], "modules without a row in tests/README.md"
    assert sorted(set(listed) - modules) == [], "rows of tests/README.md for modules that do not exist"
    assert all(listed.values()), [module for module, tests in listed.items() if not tests]


def test_every_test_file_named_exists_in_an_area_folder():
    named = {test for tests in _map().values() for test in tests}
    missing = sorted(test for test in named if not (ROOT / "tests" / test).is_file())
    assert missing == []
    assert all(test.split("/")[0] in AREAS for test in named)


def test_no_test_file_outside_the_area_folders():
    stray = sorted(path.relative_to(ROOT / "tests").as_posix() for path in (ROOT / "tests").rglob("test_*.py")
                   if path.relative_to(ROOT / "tests").parts[0] not in AREAS)
    assert stray == []
