"""What a pool-size sweep shows while it runs: each row as soon as its size is replayed (every policy's, not after
the last), one progress bar for the whole command, and a plot whose height fits its curves."""

import pytest

from workloads.cli import main
from workloads.commands import trace_replay
from workloads.harness import progress
from workloads.sizing import sweep as sweep_module
from workloads.sizing.plot import top_of


def test_each_row_prints_before_the_next_size_is_replayed(monkeypatch, capsys):
    printed_before = []  # (pool tokens, eviction, everything printed so far) as each replay starts
    real = sweep_module.replay_trace

    def watched(*args, **kw):
        printed_before.append((kw["pool_tokens"], kw["eviction"], capsys.readouterr().out))
        return real(*args, **kw)
    monkeypatch.setattr(sweep_module, "replay_trace", watched)
    assert main(["replay", "--limit", "40", "--pool-tokens", "64k,1M", "--eviction", "lru,lfu", "--no-progress"]) == 0
    so_far, ceilings = "", 0
    for size, eviction, out in printed_before:
        so_far += out
        if (size, eviction) == (1 << 20, "lru"):  # lru's 64k row is out before its 1M replay starts
            assert "eviction lru:" in so_far and "        64k |" in so_far and "         1M |" not in so_far
        if size is None:  # each policy's sweep starts with its ceiling
            ceilings += 1
            if ceilings == 2:  # lfu's starts once lru's rows are all out
                assert so_far.count("         1M |") == 1 and "eviction lfu:" not in so_far
    assert ceilings == 2 and so_far.count("        64k |") == 2  # lfu's 64k row too, before its 1M replay


def test_one_progress_bar_for_the_whole_command(monkeypatch, capsys):
    bars = []

    class Bar:
        def __init__(self, total, desc, enabled=True):
            self.total, self.steps = total, 0
            bars.append(self)

        def update(self, n=1):
            self.steps += n

        def write(self, text, file=None):
            print(text, file=file)

        def close(self):
            pass
    monkeypatch.setattr(progress, "progress_bar", Bar)
    monkeypatch.setattr(trace_replay, "progress_bars", lambda args: True)
    assert main(["replay", "--limit", "40", "--pool-tokens", "64k,1M,inf", "--eviction", "lru,lfu"]) == 0
    # lru: ceiling, 64k, 1M, the optimum at 64k and 1M; lfu: ceiling, 64k, 1M (the optimum is not replayed again)
    assert len(bars) == 1 and bars[0].total == bars[0].steps == (5 + 3) * 40
    assert capsys.readouterr().out.count("pool tokens |") == 2


@pytest.mark.parametrize("values, top", [([3.4, 8.1], 10), ([44.0, 37.3], 50), ([97.4, 97.65], 100), ([], 5),
                                         ([0.0], 5), ([51.0], 60)])
def test_the_plot_ends_just_above_its_highest_curve(values, top):
    assert top_of(values) == top
