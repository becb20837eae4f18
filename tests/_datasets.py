"""A map-style dataset over a list of items, without the metadata (``sample_lengths``, grids) a scan could
read instead: what the lengths scan and ``bridge-thd scan`` must collate to measure (shared by
tests/unit/test_batching_sampler.py and tests/bridge/test_scan.py)."""


class ListDataset:
    """``items[index]`` for each index; nothing else."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]
