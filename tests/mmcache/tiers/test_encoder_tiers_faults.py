"""Encoder lookups never stall on the shared store (real Mooncake master on 127.0.0.1): under steady lookups whose
every key misses on the device and asks the store, the master is killed mid-run; every lookup stays within the
store's deadline plus scheduling slack, each result is still right (the encoder runs), and after a restart lookups hit
the store again."""

import time

import pytest
import torch

from mmcache import EncoderKey, EncoderStore
from mmcache.tiers import EncoderTiers, StoreTier, encoder_entry, mooncake
from mooncake_master import MooncakeMaster

WHY = mooncake.available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"Mooncake Store cannot run here: {WHY}")
DEADLINE = 0.1
SLACK = 0.4  # a loaded, shared 2-core VM: scheduling, the encoder, GIL hand-offs
DEAD_S = 5.0  # past Mooncake's ~4.4 s stalls of a get or put to a dead master
KEYS = [EncoderKey(bytes([i]) * 16, "enc-faults/v1", "image") for i in range(8)]


def encode(i: int) -> torch.Tensor:
    """The encoder: a pure function of the input, so every result can be checked."""
    return torch.arange(256, dtype=torch.float32) * (i + 1)


@pytest.mark.slow
def test_a_master_killed_under_encoder_lookups_never_stalls_one_and_a_restart_hits_again():
    with MooncakeMaster() as master:
        client = mooncake.MooncakeClient(master.rpc_address, master.metadata_url, 64 << 20, 32 << 20)
        tier = StoreTier(client, deadline_s=DEADLINE, probe_s=0.3)
        store = EncoderStore(1 << 16, 1024, tiers=EncoderTiers(store=tier))
        ran = [0]

        def lookup(batch: list[int]):
            def compute(indices):
                ran[0] += len(indices)
                return [encode(batch[i]) for i in indices]
            t = time.perf_counter()
            got = store.get_or_compute_many([KEYS[i] for i in batch], compute)
            took = time.perf_counter() - t
            assert all(torch.equal(g.value, encode(i)) for g, i in zip(got, batch))  # always the right output
            return took, [g.source for g in got]

        try:
            lookup(list(range(len(KEYS))))
            assert tier.flush(30) and tier.counters["published_entries"] == len(KEYS)
            phases = {"up": [], "dead": [], "restarted": []}
            sources = {k: [] for k in phases}
            start, i, killed, restarted = time.monotonic(), 0, None, None
            while True:
                now = time.monotonic() - start
                if killed is None and now > 0.5:
                    master.stop()  # killed mid-run
                    killed = now
                elif restarted is None and killed is not None and now > killed + DEAD_S:
                    master.start()
                    restarted = now
                phase = "up" if killed is None else "dead" if restarted is None else "restarted"
                store.clear()  # the device forgets: every lookup asks the store
                took, got = lookup([i % len(KEYS), (i + 1) % len(KEYS)])
                phases[phase].append(took)
                sources[phase] += got
                i += 2
                if phase == "restarted" and (sources[phase].count("shared") >= 6 or now > restarted + 25):
                    break
                time.sleep(0.01)
            worst = {k: max(v) for k, v in phases.items()}
            assert all(v < DEADLINE + SLACK for v in worst.values()), (worst, tier.counters)
            assert set(sources["up"]) == {"shared"} and "computed" in sources["dead"]
            assert len(phases["dead"]) > 30 and tier.counters["late"] + tier.counters["failures"] >= 1
            assert tier.counters["skipped"] > 0 and tier.counters["probes"] > 0
            assert sources["restarted"].count("shared") >= 6, tier.counters
            t = store.stats().totals
            assert t.store_hits == sum(s.count("shared") for s in sources.values())
            assert ran[0] == len(KEYS) + sum(s.count("computed") for s in sources.values())
        finally:
            tier.close()
            client.close()


@pytest.mark.slow
def test_a_forged_shared_entry_is_removed_and_the_real_one_served_after_its_next_publish():
    """A forger puts under a key's entry name first (Mooncake's put never overwrites): the first reader refuses it
    (MAC) and removes it, its own publish then stores the real entry, and another instance is served that."""
    key_bytes = b"deployment-key-0123456789abcdef"
    with MooncakeMaster() as master:
        client = mooncake.MooncakeClient(master.rpc_address, master.metadata_url, 64 << 20, 32 << 20)
        tiers = [StoreTier(client, deadline_s=DEADLINE, key=key_bytes) for _ in range(2)]
        a, b = (EncoderStore(1 << 16, 1024, tiers=EncoderTiers(store=t)) for t in tiers)
        try:
            assert client.put(encoder_entry.entry_key(KEYS[0]), b"forged" * 100) in ("stored", True)
            got = a.get_or_compute_many([KEYS[0]], lambda idx: [encode(0)])[0]
            assert got.source == "computed" and a.stats().totals.store_mac_failures == 1
            assert tiers[0].flush(30)
            got = b.get_or_compute_many([KEYS[0]], never)[0]
            assert got.source == "shared" and torch.equal(got.value, encode(0))
            assert b.stats().totals.store_mac_failures == 0
            c = tiers[0].counters
            assert c["refused_removed"] == 1 and c["published_entries"] == 1, c  # stored after the forgery went
        finally:
            for t in tiers:
                t.close()
            client.close()


def never(indices):
    raise AssertionError("computed what the store holds")
