"""``vlm-mstar``: vlm-chat's image questions served through M*'s real ``Engine`` (``workloads.harness.mstar_serving``
with ``thinker_steps``): M*'s Qwen3-Omni ``VisionEncoderSubmodule`` (a tiny sdpa tower loaded by M*'s loader) and
``ThinkerSubmodule`` (loaded by M*'s ``get_submodule("Thinker")``) on one engine, text output, reuse off (M*'s
``KVManager``) vs on (``ReuseKVManager`` under ``qwen3_omni_reuse`` and the vision node behind ``CachedEncoderNode``),
2 requests in flight on the same ``closed:2`` schedule, on the embedded default (no data folder).

- every request's generated token ids are equal off and on (the exactness gate), and both reports name the engine
  and the requests in flight;
- with reuse on the prefills compute fewer prompt rows (a session's follow-up re-sends the turn before it, image and
  reply included) and the vision tower runs for fewer images (users of an image, and follow-ups, find its outputs);
- a request whose image does not decode fails alone (its follow-ups with it), the others are served;
- a follow-up's walks are the previous turn's with the reply and the follow-up in its last text walk;
- the command line runs it with no ``../shared`` data and no ``$MMCACHE_DATA`` to read, and says the same.
"""

import pytest

from mstar_helpers import require_mstar

require_mstar()
from workloads import registry  # noqa: E402
from workloads.harness.mstar_serving import compare_mstar  # noqa: E402
from workloads.harness.serving import Schedule  # noqa: E402
from workloads.models import vlm_mstar  # noqa: E402
from workloads.options import ModelWorkloadOptions  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    # 6 requests: image 0's first two users, each a first turn and two follow-ups
    return vlm_mstar.factory(ModelWorkloadOptions(model_dir=tmp_path_factory.mktemp("qwen3-omni"), limit=6,
                                                  max_new_tokens=4))


def images_encoded(run) -> int:
    return sum(r.result.encoder_items["image"] - r.result.encoder_hits["image"] for r in run.records)


def test_reuse_on_and_off_generate_the_same_tokens_and_on_computes_less(made):
    off, on, equal = compare_mstar(made, Schedule("closed", concurrency=2), 2)
    assert equal == len(off.records) == len(on.records) == 6
    for run in (off, on):
        assert f"via {vlm_mstar.ENGINE}, 2 in flight" in run.schedule
        assert all(r.result.output_tokens == 4 and r.ttft_s > 0 for r in run.records)
    assert all(r.result.hit_tokens == 0 for r in off.records) and images_encoded(off) == 6
    assert on.computed_tokens < off.computed_tokens // 2 and images_encoded(on) == 1
    follow_up = {r.rid: r.result for r in on.records}["i0u0t1"]
    assert follow_up.prompt_tokens - follow_up.hit_tokens < follow_up.prompt_tokens // 4


def test_a_request_whose_image_does_not_decode_fails_alone(made):
    """Its follow-ups fail too (nothing to re-send); the other session is served, equal off and on."""
    import dataclasses

    from workloads.models import vlm_chat

    bad, good = [["What is in <this>?", b"not an image"]], vlm_chat.embedded_items(0)[0][:1]
    broken = dataclasses.replace(made, requests=tuple(vlm_mstar.sessions([bad, good])))
    off, on, equal = compare_mstar(broken, Schedule("closed", concurrency=2), 2)
    for run in (off, on):
        failed = {r.rid: r.error_type for r in run.records if not r.ok}
        assert failed == {"i0u0t0": "InvalidMedia", "i0u0t1": "InvalidRequest", "i0u0t2": "InvalidRequest"}
    assert equal == 3


def test_a_follow_up_re_sends_the_turn_before_it_with_its_reply(made):
    w = made()
    first, second = w.requests()[:2]
    walks = w.walks(first)
    assert [kind for kind, _ in walks] == [vlm_mstar.TEXT, vlm_mstar.IMAGE, vlm_mstar.TEXT]
    assert walks[0][1][:3] == [vlm_mstar.IM_START, vlm_mstar.SYSTEM, ord("\n")]
    w.outputs[first.rid] = [7, 8, 9]
    again = w.walks(second)
    assert again[:2] == walks[:2]
    assert again[2][1] == walks[2][1] + [7, 8, 9] + list(second.payload.follow_up)
    assert second.payload.follow_up[:2] == (vlm_mstar.IM_END, ord("\n"))


def test_the_command_line_serves_the_embedded_default_without_shared_data(made, tmp_path, monkeypatch, capsys):
    from workloads.cli import main

    missing = tmp_path / "no-shared" / "data"
    monkeypatch.setattr(registry, "default_data", lambda: missing)
    monkeypatch.delenv(registry.DATA_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MMCACHE_MODEL_DIR", str(made.weights.parent))
    assert all(isinstance(x, bytes) for r in made.requests if r.payload.turn == 0
               for kind, x in r.payload.parts if kind == vlm_mstar.IMAGE)  # embedded images: nothing read
    assert main(["replay", "vlm-mstar", "--limit", "3", "--in-flight", "2", "--schedule", "closed:2",
                 "--max-new-tokens", "2", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "vlm-mstar (embedded default)" in printed
    assert f"via {vlm_mstar.ENGINE}, 2 in flight" in printed
    assert "generated token ids (greedy) equal cache off / on: 3 of 3 requests" in printed
    assert "prompt rows computed cache off / on:" in printed and not missing.exists()
