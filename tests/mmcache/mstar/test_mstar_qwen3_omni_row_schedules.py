"""Random schedules of Qwen3-Omni thinker requests under M*'s real ``Engine`` on CPU, reuse on and off, on a pool
small enough that every few requests evict cached pages and hand their ids to others
(``workloads/peers/mstar_qwen3_omni.py``): requests share system turns and images, ask for audio output or not, and
some run with no watched forward (as a replayed CUDA graph runs no hook: their pages' states are not kept). Every
request's tokens, logits, rows and positions, and, with audio output, the talker's edge on every walk (the states
and mask M*'s postprocess is handed, and what it sends on), are ``torch.equal`` to reuse off: the thinker's states
kept beside the KV pages are never served stale (a page's rows are forgotten when its id is taken fresh) nor where
they were not kept."""

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mstar_helpers import require_mstar

require_mstar()
from mstar_qwen3_omni_helpers import fed, ids, image, serve, spoken_same, system_turn  # noqa: E402
from workloads.peers import mstar_cpu_kernels as kernels  # noqa: E402
from workloads.peers import mstar_qwen3_omni as q  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
SYSTEMS = (system_turn(13, 60), system_turn(9, 61))
IMAGES = (image(62), image(63))


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return q.save_weights(tmp_path_factory.mktemp("qwen3-omni-thinker"))


@pytest.fixture(scope="module")
def sampled():
    """The shared stand-ins (``conftest.sampled``), installed once for this module's hypothesis tests
    (``installed``: a module-scoped fixture has no monkeypatch)."""
    with kernels.installed(keep_logits=True) as record:
        yield record


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@pytest.mark.slow
@given(st.data())
def test_any_schedule_hands_the_talker_what_reuse_off_does(weights, sampled, data):
    on, off = q.thinker_engine(weights, reuse=q.thinker_reuse(), pages=10), q.thinker_engine(weights, pages=10)
    spoken_cut = 0
    for n in range(data.draw(st.integers(3, 8), label="requests")):
        walks = [(q.TEXT, SYSTEMS[data.draw(st.integers(0, 1), label="system")])]
        picture = data.draw(st.sampled_from((None, 0, 1)), label="image")
        if picture is not None:
            walks.append((q.VISION, IMAGES[picture]))
        walks.append((q.TEXT, ids(data.draw(st.integers(2, 6), label="tail"), 100 + n)))
        talk = data.draw(st.booleans(), label="audio output")
        if data.draw(st.booleans(), label="watched"):
            got = serve(on, sampled, f"r{n}", walks, new=1, audio_output=talk)
        else:  # its forwards unseen: the commit keeps no states for its pages
            on.kv._rows_to_write = lambda step: None
            got = serve(on, sampled, f"r{n}", walks, new=1, audio_output=talk)
            del on.kv._rows_to_write
        want = serve(off, sampled, f"r{n}", walks, new=1, audio_output=talk)
        assert spoken_same(got, want), f"request {n}"
        if talk and fed(got) != fed(want):
            spoken_cut += 1
    event(f"spoken requests cut: {min(spoken_cut, 2)}+")
    event(f"eviction batches: {min(on.kv._arena.allocator.counters['eviction_batches'], 1)}+")
