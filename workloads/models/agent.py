"""Model-backed text workloads, and the serving core that ``vlm_chat`` shares.

Workloads (each ``factory(options) -> Callable[[], Workload]``, see ``workloads.options``):
- ``agent-model`` (``factory``): agent sessions whose every call re-sends the whole history. Real data: the
  mini-swe-agent trajectories under ``<data>/mini-swe-agent/trajs`` (``workloads.traces.swe_agent``: the history holds the
  recorded replies). Embedded default: generated sessions of the same shape (a shared system prompt, a task, then
  command / tool-output turns), tokenized with the same SentencePiece model.
- ``mooncake-model`` (``mooncake_factory``): the Mooncake conversation trace
  (``<data>/mooncake/conversation_trace.jsonl``) or the embedded 2,000-line slice. Each request keeps its first
  ``MOONCAKE_BLOCKS`` blocks, every 512-token block scaled down to ``2 * page_size`` tokens drawn from its hash id
  alone, so equal ids still mean equal prefixes.
Agent prompts are never truncated (that would break their prefix structure): instead at most ``CALLS_PER_SESSION``
calls of each trajectory are served, and ``options.limit`` (default ``DEFAULT_LIMIT``, ``MOONCAKE_DEFAULT_LIMIT``)
caps the requests, in listed order.

Serving (``serve_request``): greedy decode of ``options.max_new_tokens`` tokens on a causal LM, one request at a time.
Cache on: a ``PagedKVCache`` admits the prompt, the model is fed only the unmatched rest, and the prompt's full pages
go to the index at the end. Cache off: a fresh ``DynamicCache`` and the whole prompt. Both prefill in page-sized
chunks (``chunk_spans``), so a position is computed by the forward over the same page in both runs. Only prompt pages
are indexed: a generated reply enters the index when the next turn re-sends it as part of its prompt (and prefills
it), so every indexed page was written by exactly the forward the cache-off run computes it with, and cache on and
off generate the same tokens, bit for bit (DESIGN.md, correctness gate), while the cache-off run stays a plain
chunked prefill. The price is recomputing each re-sent reply once (``max_new_tokens`` tokens per turn).

Tiny models: hubs are unreachable, so without ``options.model`` a small Llama is built from its config with seeded
random weights, saved once under ``options.model_dir`` (in a folder named by a hash of the config) and loaded back
with ``from_pretrained``, like a real checkpoint. ``options.model`` loads a user's local folder instead; its own
tokenizer is used when the folder has one.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import xxhash
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, LlamaConfig

from mmcache.hf import runner
from encoders.base import module_fingerprint
from mmcache.hf.paged_kv import PagedKVCache, kv_page_shape
from mmcache.hf.runner import chunk_spans
from mmcache import ShadowIndex
from mmcache.errors import InvalidRequest, TraceError

from workloads import registry
from workloads.harness.metrics import RequestResult
from workloads.options import ModelWorkloadOptions
from workloads.traces.mooncake import load_mooncake
from workloads.harness.serving import Clock, Request
from workloads.traces.swe_agent import Trajectory, load_swe_agent, load_tokenizer, render
from workloads.traces.text_trace import CallInfo

CALLS_PER_SESSION = 4
DEFAULT_LIMIT = 12            # requests of agent-model (its real prompts run to tens of thousands of tokens)
MOONCAKE_DEFAULT_LIMIT = 200  # requests of mooncake-model
MOONCAKE_BLOCKS = 4
SEED = 0                      # weights of the tiny models (fixed, so their saved folders are reused)

# --------------------------------------------------------------------------------------------- models and tokenizers
def tiny_folder(model_dir: Path, kind: str, config, save: Callable[[Path], None]) -> Path:
    """``model_dir/<kind>-<hash of config>``, written by ``save(folder)`` under ``SEED`` the first time (into a
    temporary folder renamed into place, so a concurrent or interrupted first run never leaves half a model there)
    and reused after."""
    folder = Path(model_dir) / f"{kind}-{xxhash.xxh64_hexdigest(config.to_json_string().encode())}"
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        with torch.random.fork_rng():
            torch.manual_seed(SEED)
            save(tmp)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / "config.json").is_file():  # else another process got there first
            raise
    return folder


def load_model(cls, options: ModelWorkloadOptions, kind: str, config, save: Callable[[Path], None] | None = None,
               model_types: Sequence[str] = ()):
    """``(model, folder)`` in eval mode, loaded with ``cls`` (an ``AutoModel...`` class): ``options.model`` if given
    (its ``model_type`` one of ``model_types`` when they are named, else ``ValueError``), else the tiny
    ``cls.from_config(config)`` saved by ``tiny_folder`` (``save`` adds files next to the weights, e.g. an image
    processor)."""
    def save_all(folder: Path) -> None:
        cls.from_config(config).save_pretrained(folder)
        if save is not None:
            save(folder)

    folder = options.model
    if folder is None:
        folder = tiny_folder(options.model_dir, kind, config, save_all)
    elif model_types and (found := AutoConfig.from_pretrained(folder).model_type) not in model_types:
        raise ValueError(f"{folder} holds a {found!r} model; this workload runs {', '.join(model_types)} models")
    return cls.from_pretrained(folder).eval(), folder


class _HFTokenizer:
    """A transformers tokenizer behind the two calls the loaders make on a SentencePiece processor."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.tok(texts, add_special_tokens=False)["input_ids"]

    def bos_id(self) -> int:
        return next(t for t in (self.tok.bos_token_id, self.tok.eos_token_id, 0) if t is not None)


def text_tokenizer(folder: Path | None):
    """The tokenizer of a user's model folder when it has one, else the SentencePiece model of ``mistral_common``
    (what the tiny models' vocabulary is sized for)."""
    if folder is not None and any((Path(folder) / f).is_file() for f in
                                  ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer
        return _HFTokenizer(AutoTokenizer.from_pretrained(folder))
    return load_tokenizer()


def check_vocab(requests: Sequence[Request], ids: Callable[[Request], Sequence[int]], vocab_size: int) -> None:
    """InvalidRequest naming the first request with a token id the model cannot embed."""
    for req in requests:
        top = max(ids(req), default=0)
        if top >= vocab_size:
            raise InvalidRequest(f"request {req.rid!r} has token id {top}, beyond the model's vocabulary of "
                                 f"{vocab_size}: give --model a folder with its own tokenizer")


# ------------------------------------------------------------------------------------------------------- serving core
@torch.inference_mode()
def generate(model, cache, token_ids, spans: list[tuple[int, int]], max_new_tokens: int, clock: Clock,
             embed: runner.Embed | None = None) -> list[int]:
    """Prefill ``spans`` on ``cache`` (stage ``prefill``), then decode greedily one token per forward, calling
    ``clock.token()`` as each token is chosen; the last token is returned, never fed."""
    with clock.stage("prefill"):
        logits = runner.replay(model, cache, token_ids, spans, embed=embed).logits[-1]
    out: list[int] = []
    for step in range(max_new_tokens):
        out.append(int(logits.argmax()))
        clock.token()
        if step + 1 < max_new_tokens:
            step_ids = torch.tensor([out[-1:]], device=model.device)
            logits = model(input_ids=step_ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    return out


def serve_request(model, kv: PagedKVCache | None, rid: str, token_ids, page_size: int, *, max_new_tokens: int,
                  clock: Clock, media: Sequence = (), prepare: Callable[[int], runner.Embed | None] = lambda m: None
                  ) -> tuple[list[int], int]:
    """``(output ids, matched tokens)`` of one request, prefilled in chunks of ``page_size`` (``chunk_spans``).

    ``kv=None``: the cache-off run, the whole prompt on a fresh ``DynamicCache``. Otherwise ``kv`` admits the prompt,
    the chunks from the matched length on run, and the prompt's full pages are indexed at the end (not the output's:
    see the module docstring); any error aborts the request, so a failed request indexes nothing.
    ``prepare(matched)`` runs after admission and before prefill and returns the ``inputs_embeds`` function, if any
    (VLMs encode there the images the unmatched rest needs).
    """
    n = len(token_ids)
    if kv is None:
        return generate(model, DynamicCache(config=model.config), token_ids, chunk_spans(0, n, page_size),
                        max_new_tokens, clock, prepare(0)), 0
    matched = kv.admit(rid, token_ids, media=media).matched_tokens
    try:
        out = generate(model, kv, token_ids, chunk_spans(matched, n, page_size), max_new_tokens, clock,
                       prepare(matched))
    except BaseException:
        kv.abort(rid)
        raise
    kv.finish(rid)
    return out, matched


def trace_order(requests: Sequence[Request]) -> list[Request]:
    """``requests`` in the order the ``trace`` schedule serves them (arrival time, ties in listed order)."""
    return sorted(requests, key=lambda r: r.arrival_s)


def prefix_ceiling(shadow: ShadowIndex) -> float:
    """Prompt tokens an unbounded prefix cache would serve, as a share of all prompt tokens admitted to ``shadow``."""
    prompt = sum(r.prompt_tokens for r in shadow.records)
    return sum(r.matched_pages for r in shadow.records) * shadow.page_size / prompt if prompt else 0.0


# ------------------------------------------------------------------------------------------------------ the workload
class TextWorkload:
    """Requests whose payload is an int32 prompt, served through one causal LM with a fresh ``PagedKVCache``;
    ``outputs`` maps each completed request to its generated tokens.

    An agent's later calls re-send the recorded replies, not the generated ones, so generated tokens are never
    reused here."""

    def __init__(self, name: str, model, requests: list[Request], options: ModelWorkloadOptions, fingerprint: str):
        self.name, self.model, self._requests = name, model, requests
        self.page_size, self.max_new_tokens = options.page_size, options.max_new_tokens
        self.kv = PagedKVCache.for_model(model, options.pool_pages, options.page_size, fingerprint=fingerprint)
        self.outputs: dict[str, list[int]] = {}
        self._ceilings: tuple[dict, dict] | None = None

    def requests(self) -> list[Request]:
        return self._requests

    def serve(self, req: Request, cached: bool, clock: Clock) -> RequestResult:
        ids, P = req.payload, self.page_size
        out, matched = serve_request(self.model, self.kv if cached else None, req.rid, ids, P,
                                     max_new_tokens=self.max_new_tokens, clock=clock)
        self.outputs[req.rid] = out
        return RequestResult(prompt_tokens=ids.size, hit_tokens=matched, prompt_pages=ids.size // P,
                             hit_pages=matched // P, output_tokens=len(out))

    def cache_stats(self) -> dict:
        return {"prefix": self.kv.prefix.stats().to_dict()}

    def ceilings(self) -> dict[str, float]:
        """The unbounded-cache prefix hit rate over the prompts in trace order."""
        return self._shadow()[0]

    def ceiling_weights(self) -> dict[str, int]:
        """What each ceiling is a share of (prompt tokens), so a blend of workloads can weigh them."""
        return self._shadow()[1]

    def _shadow(self) -> tuple[dict, dict]:
        if self._ceilings is None:
            shadow = ShadowIndex(self.kv.prefix.fingerprint)
            for req in trace_order(self._requests):
                shadow.admit(req.rid, req.payload)
                shadow.finish(req.rid)
            self._ceilings = ({"prefix": prefix_ceiling(shadow)},
                              {"prefix": sum(r.prompt_tokens for r in shadow.records)})
        return self._ceilings


def tiny_llama_config(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 17)


def _text_factory(name: str, options: ModelWorkloadOptions, requests: Callable[[int], list[Request]]):
    """Load the model (tiny Llama unless ``options.model``) and ``requests(vocab_size)`` once; each call of the
    result: a fresh workload (empty caches) over them."""
    model, _ = load_model(AutoModelForCausalLM, options, "tiny-llama", tiny_llama_config(32768))
    kv_page_shape(model.config, options.page_size)  # ValueError now, for a model whose KV pages cannot stand for
    vocab = model.config.get_text_config(decoder=True).vocab_size
    reqs = requests(vocab)
    check_vocab(reqs, lambda r: r.payload, vocab)
    fingerprint = module_fingerprint(model)
    return lambda: TextWorkload(name, model, reqs, options, fingerprint)


# ------------------------------------------------------------------------------------------------------- agent-model
_WORDS = ("parser", "config", "value", "index", "request", "cache", "token", "buffer", "handler", "schema", "model",
          "field", "default", "error", "path", "module", "result", "offset", "stream", "record", "format", "limit")
_SYSTEM = ("You are a software engineer working in a Linux shell on a repository. Each reply has a short THOUGHT "
           "and exactly one bash command in a fenced block. The command runs and its output is the next message. "
           "Read code before editing it, change only what the task needs, run the tests, and finish with "
           "`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` when the fix is done.")


def _agent_messages(rng: np.random.Generator, calls: int) -> list[tuple[str, str]]:
    """One generated session: system, task, then ``calls`` command / tool-output pairs (roles as in the traces)."""
    words = lambda k: " ".join(rng.choice(_WORDS, k))  # noqa: E731
    task = f"Fix the issue: {words(12)}.\nSteps to reproduce:\n" + "\n".join(f"- {words(8)}" for _ in range(4))
    messages = [("system", _SYSTEM), ("user", task)]
    for _ in range(calls):
        path = f"src/{rng.choice(_WORDS)}/{rng.choice(_WORDS)}.py"
        messages.append(("assistant", f"THOUGHT: {words(10)}.\n\n```bash\ngrep -n {rng.choice(_WORDS)} {path}\n```"))
        lines = "\n".join(f"{path}:{rng.integers(1, 900)}: {words(int(rng.integers(4, 14)))}"
                          for _ in range(int(rng.integers(6, 24))))
        messages.append(("user", f"<returncode>0</returncode>\n<output>\n{lines}\n</output>"))
    return messages


def _trajectory(name: str, messages: list[tuple[str, str]], tok, start_s: float, gap_s: float) -> Trajectory:
    """A ``swe_agent.Trajectory`` of generated messages, tokenized exactly as ``load_swe_agent`` does."""
    arrays = [np.asarray(t, dtype=np.int32) for t in tok.encode([render(r, c) for r, c in messages])]
    lengths = np.cumsum([0] + [a.size for a in arrays]) + 1
    calls = [CallInfo(start_s + i * gap_s, int(lengths[2 * i + 2]), int(arrays[2 * i + 2].size))
             for i in range((len(arrays) - 1) // 2)]
    return Trajectory(name, np.array([tok.bos_id()], dtype=np.int32), arrays, calls)


def _agent_requests(options: ModelWorkloadOptions) -> list[Request]:
    tok, limit = text_tokenizer(options.model), options.limit or DEFAULT_LIMIT
    sessions = -(-limit // CALLS_PER_SESSION)
    if options.data is None:
        rng = np.random.default_rng(options.seed)
        trajs = [_trajectory(f"gen-{s}", _agent_messages(rng, CALLS_PER_SESSION), tok, 1.5 * s, 6.0)
                 for s in range(sessions)]
    else:
        trace = load_swe_agent(Path(options.data) / registry.MODEL_WORKLOADS["agent-model"].data_path,
                               limit=sessions, tokenizer=tok)
        if trace.errors:
            raise trace.errors[0]
        trajs = trace.sessions
    calls = (t.build(i) for t in trajs for i in range(min(CALLS_PER_SESSION, len(t.calls))))
    return [Request(c.rid, c.session, c.arrival_s, c.token_ids) for c in itertools.islice(calls, limit)]


def factory(options: ModelWorkloadOptions) -> Callable[[], TextWorkload]:
    """``agent-model``: agent calls re-sending their history, through a tiny Llama (or ``options.model``)."""
    return _text_factory("agent-model", options, lambda vocab: _agent_requests(options))


# ---------------------------------------------------------------------------------------------------- mooncake-model
def _block(hash_id: int, size: int, vocab: int) -> np.ndarray:
    """``size`` tokens in ``[0, vocab)`` that are a function of ``hash_id`` alone."""
    return np.random.default_rng(int(hash_id) % (1 << 64)).integers(0, vocab, size, dtype=np.int32)


def scaled_prompt(hash_ids: Sequence[int], input_length: int, block: int, vocab: int) -> np.ndarray:
    """The first ``MOONCAKE_BLOCKS`` blocks of a Mooncake request, ``block`` tokens per 512-token block, the last one
    cut in proportion to ``input_length``; equal id prefixes give equal token prefixes."""
    ids = list(hash_ids[:MOONCAKE_BLOCKS])
    n = min(-(-input_length * block // 512), len(ids) * block)
    return np.concatenate([_block(h, block, vocab) for h in ids])[:n]


def mooncake_factory(options: ModelWorkloadOptions) -> Callable[[], TextWorkload]:
    """``mooncake-model``: the Mooncake conversation trace (or its embedded slice), scaled down, through a tiny
    Llama (or ``options.model``); each 512-token block becomes ``2 * page_size`` tokens."""
    path = (registry.embedded_slice() if options.data is None
            else Path(options.data) / registry.MODEL_WORKLOADS["mooncake-model"].data_path)

    def requests(vocab: int) -> list[Request]:
        trace = load_mooncake(path, limit=options.limit or MOONCAKE_DEFAULT_LIMIT)
        if trace.errors:
            raise trace.errors[0]
        if not trace.sessions:
            raise TraceError(path, None, "no requests")
        return [Request(s.name, s.name, s.calls[0].arrival_s,
                        scaled_prompt(s.hash_ids, s.calls[0].prompt_len, 2 * options.page_size, vocab))
                for s in trace.sessions]

    return _text_factory("mooncake-model", options, requests)
