"""The vLLM engine on a tiny random Llama built here: greedy equals transformers, rows join
and leave, abort frees the slot, EOS / ignore_eos / min_tokens / max_tokens, prefix-cache
stats, load errors, the engine's processes, log-probabilities against vLLM's own and transformers'
forward pass. One engine for the module."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("vllm")

import psutil  # noqa: E402

from ballast.errors import EngineRefused  # noqa: E402
from ballast.model.demo import VLLM_GEOMETRY, make_llama  # noqa: E402
from ballast.model.engine import ModelLoadError  # noqa: E402
from ballast.model.hf_checkpoint import tokenizer_id  # noqa: E402
from ballast.model.hf_text import ContextTooLong  # noqa: E402
from ballast.model.protocol import BATCH_PRIORITY, Join, RowSampling  # noqa: E402
from ballast.model.vllm_engine import VLLMBackend, VLLMStats  # noqa: E402

ENGINE_KWARGS = dict(
    dtype="float32",
    enforce_eager=True,
    max_model_len=512,
    max_num_seqs=8,
    enable_prefix_caching=True,
    # as a YAML config gives it; compact JSON, so that random weights end their answer
    structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
)
PROMPTS = ["The quick brown fox", "Hello!", "A replica serves requests; the router sends each one to"]
LONG = RowSampling(ignore_eos=True)


def random_contexts(vocab_size, bos_id, n=2000):
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab_size, (n, 3), generator=gen)
    return torch.cat([torch.full((n, 1), bos_id), ids], dim=1)


def make_eos_reachable(d):
    """Give EOS the output row of a rarely predicted token, a little larger: random weights
    never pick EOS, and the EOS tests need contexts where greedy decoding does."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype="float32").eval()
    with torch.inference_mode():
        picks = model(random_contexts(model.config.vocab_size, tok.bos_token_id)).logits[:, -1, :].argmax(-1)
    counts = torch.bincount(picks, minlength=model.config.vocab_size)
    counts[counts < 5] = 1 << 30
    rare = int(counts.argmin())
    state = load_file(str(d / "model.safetensors"))
    state["lm_head.weight"][tok.eos_token_id] = state["lm_head.weight"][rare] * 1.05
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = make_llama(tmp_path_factory.mktemp("vllm-llama"), **VLLM_GEOMETRY)
    make_eos_reachable(d)
    return d


@pytest.fixture(scope="module")
def backend(ckpt):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of CPU KV cache
        b = VLLMBackend(str(ckpt), name="tiny-vllm", engine_kwargs=ENGINE_KWARGS, prefix_report_blocks=4096)
    yield b
    b.shutdown()


@pytest.fixture(scope="module")
def hf_model(ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype="float32").eval()


def drain(batch, joins_by_chunk, steps=4, max_chunks=200):
    """Drive ``batch``: ``joins_by_chunk[i]`` join before chunk i; every row's ids, to the end."""
    got: dict = {}
    i = 0
    while i < len(joins_by_chunk) or batch.keys():
        assert i < max_chunks, f"rows {batch.keys()} still running after {max_chunks} chunks"
        joins = joins_by_chunk[i] if i < len(joins_by_chunk) else []
        out = batch.run_chunk(joins, steps)
        assert {j.key for j in joins} <= set(out)
        for key, ids in out.items():
            got.setdefault(key, []).extend(ids)
        i += 1
    return got


def hf_greedy(hf_model, ids, n, eos_id):
    import torch

    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos_id, pad_token_id=eos_id
        )
    return out[0, len(ids) :].tolist()


def test_describes_itself_and_fits_prompts(backend):
    d = backend.describe()
    assert d["backend"] == "vllm" and d["device"] == "cpu" and d["max_seq_len"] == 512
    assert d["params"] and d["params"] > 100_000
    assert backend.eos_ids == {backend.tokenizer.eos_token_id}
    ids, n = backend.text.fit(backend.text.tokenize("Hello"), 10_000)
    assert ids[0] == backend.tokenizer.bos_token_id and n == 512 - len(ids)
    assert ids == backend.text.encode("Hello", 0) and backend.tokenizer_id == tokenizer_id(backend.source)
    with pytest.raises(ContextTooLong):
        backend.text.tokenize("", add_special_tokens=False)
    with pytest.raises(ContextTooLong):
        backend.text.fit([1] * 512, 4)
    with pytest.raises(ContextTooLong):
        backend.text.encode("", 4, add_special_tokens=False)
    with pytest.raises(ContextTooLong):
        backend.text.encode("Hello", 512)
    assert isinstance(backend.stats(), VLLMStats)
    text = "".join(backend.text.stream_decoder().feed([i], final=False) for i in ids[1:])
    assert text == "Hello"


def test_greedy_equals_transformers_generate_alone_and_batched(backend, hf_model):
    eos = backend.tokenizer.eos_token_id
    prompts = [backend.text.encode(p, 24) for p in PROMPTS]
    expected = [hf_greedy(hf_model, ids, 24, eos) for ids in prompts]
    assert max(len(e) for e in expected) == 24  # not a vacuous comparison of EOS-only answers
    alone = drain(backend.open_batch(), [[Join(0, prompts[0], 24)]])
    assert alone[0] == expected[0]
    together = drain(backend.open_batch(), [[Join(i, ids, 24, None) for i, ids in enumerate(prompts)]])
    assert [together[i] for i in range(len(prompts))] == expected


def test_rows_join_and_leave_across_chunks(backend):
    ids = backend.text.encode("Hello!", 0)
    batch = backend.open_batch()
    first = batch.run_chunk([Join("a", ids, 6, LONG)], 4)
    assert set(first) == {"a"} and len(first["a"]) >= 1
    got = {"a": list(first["a"])}
    joins = [[Join("b", ids, 10, LONG), Join("z", ids, 0, LONG)], [Join("c", ids, 3, LONG)]]
    seen_done: set = set()
    for _ in range(100):
        if not (batch.keys() or joins):
            break
        out = batch.run_chunk(joins.pop(0) if joins else [], 2)
        for key, new in out.items():
            assert key not in seen_done, f"{key} got ids after it finished"
            got.setdefault(key, []).extend(new)
        seen_done |= set(out) - set(batch.keys())
    assert not batch.keys()
    assert {k: len(v) for k, v in got.items()} == {"a": 6, "b": 10, "c": 3, "z": 0}


def test_max_tokens_eos_ignore_eos_and_min_tokens(backend, hf_model):
    import torch

    eos = backend.tokenizer.eos_token_id
    # A prompt whose greedy next token is EOS, by the widest margin among many random ones.
    cands = random_contexts(hf_model.config.vocab_size, backend.tokenizer.bos_token_id)
    with torch.inference_mode():
        logits = hf_model(cands).logits[:, -1, :]
    top2 = logits.topk(2, dim=-1)
    margin = torch.where(top2.indices[:, 0] == eos, top2.values[:, 0] - top2.values[:, 1], torch.tensor(-1.0))
    assert float(margin.max()) > 0, "no random prompt predicts EOS next"
    prompt = cands[int(margin.argmax())].tolist()

    got = drain(
        backend.open_batch(),
        [
            [
                Join("eos", prompt, 20, None),
                Join("ignore", prompt, 20, RowSampling(ignore_eos=True)),
                Join("min", prompt, 20, RowSampling(min_tokens=5)),
                Join("short", backend.text.encode("Hello!", 0), 7, LONG),
            ]
        ],
    )
    assert got["eos"] == [eos]
    assert len(got["ignore"]) == 20 and got["ignore"][0] == eos
    assert len(got["min"]) >= 5 and eos not in got["min"][:5]
    assert len(got["short"]) == 7


def test_same_seed_same_tokens(backend):
    ids = backend.text.encode("Seeded sampling, please.", 0)
    s = RowSampling(temperature=1.0, top_p=0.9, top_k=50, seed=42)
    one = drain(backend.open_batch(), [[Join(0, ids, 24, s)]])[0]
    two = drain(backend.open_batch(), [[Join(0, ids, 24, s), Join(1, ids, 24, RowSampling(temperature=1.0, seed=7))]])
    assert one == two[0] and len(one) > 0
    assert two[1] != one


K = 5  # likeliest tokens asked per position
ATOL = 1e-3  # float32 engine and float32 transformers on one directory


def drain_logprobs(batch, joins, steps=3, max_chunks=200):
    """Drive ``batch`` to its end from ``joins``: every row's ids and what ``take_logprobs``
    gave it, chunk after chunk, each chunk's tokens checked against the ids it returned."""
    ids: dict = {}
    tokens: dict = {}
    prompts: dict = {}
    for i in range(max_chunks):
        out = batch.run_chunk(joins if i == 0 else [], steps)
        taken = batch.take_logprobs()
        assert set(taken) <= set(out)
        for key, new in out.items():
            ids.setdefault(key, []).extend(new)
            if key not in taken:
                continue
            lp = taken[key]
            if lp.prompt is not None:
                assert key not in prompts, f"{key}: its prompt's log-probabilities came twice"
                prompts[key] = lp.prompt
            if lp.tokens or new:  # a row asking for its tokens' gets one per id, chunk by chunk
                assert [t.id for t in lp.tokens] == new, key
                tokens.setdefault(key, []).extend(lp.tokens)
        if not batch.keys():
            return ids, tokens, prompts
    raise AssertionError(f"rows {batch.keys()} still running after {max_chunks} chunks")


def vllm_own(backend, ids, n, k):
    """The same engine asked directly through its ``AsyncLLM``, as vLLM's own callers do (the
    whole answer at once): the ids, and each generated and prompt position as (id, logprob,
    the k likeliest (id, logprob) by logprob) read from vLLM's dicts."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        max_tokens=n,
        temperature=0.0,
        ignore_eos=True,
        logprobs=k,
        prompt_logprobs=k,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )

    async def answer():
        return [o async for o in backend.llm.generate({"prompt_token_ids": list(ids)}, params, "own-logprobs")][-1]

    out = backend.loop.call(answer(), 60)

    def position(tid, d):
        top = sorted(d.items(), key=lambda kv: -kv[1].logprob)[:k]
        return tid, d[tid].logprob, [(t, lp.logprob) for t, lp in top]

    got = list(out.outputs[0].token_ids)
    return (
        got,
        [position(t, d) for t, d in zip(got, out.outputs[0].logprobs)],
        [position(t, d) for t, d in zip(ids[1:], out.prompt_logprobs[1:])],
    )


def hf_positions(hf_model, ids, k):
    """transformers' forward pass over ``ids``: for each position from the second, its id, the
    log-softmax of the logits before it, and the k likeliest."""
    import torch

    with torch.inference_mode():
        lsm = hf_model(torch.tensor([ids])).logits.float().log_softmax(-1)[0]
    out = []
    for i in range(1, len(ids)):
        top = lsm[i - 1].topk(k)
        out.append((ids[i], float(lsm[i - 1, ids[i]]), list(zip(top.indices.tolist(), top.values.tolist()))))
    return out


def assert_positions_close(got, expected, what):
    """``IdLogprobs`` against (id, logprob, top) triples: ids equal, logprobs within ATOL."""
    assert len(got) == len(expected), what
    for i, (g, (tid, lp, top)) in enumerate(zip(got, expected)):
        assert g.id == tid, (what, i)
        assert abs(g.logprob - lp) <= ATOL, (what, i, g.logprob, lp)
        assert [t for t, _ in g.top] == [t for t, _ in top], (what, i, g.top, top)
        assert all(abs(a - b) <= ATOL for (_, a), (_, b) in zip(g.top, top)), (what, i, g.top, top)


def test_logprobs_equal_vllms_own_and_transformers_forward_pass(backend, hf_model):
    # One batch: a row asking 5 for its tokens and its prompt, one asking the chosen token's
    # only, a prefill-only row (its prompt's, no token) and a row asking nothing, side by side.
    n = 12
    prompts = {key: backend.text.encode(p, n) for key, p in zip(("lp", "plain", "echo"), PROMPTS)}
    batch = backend.open_batch()
    joins = [
        Join("lp", prompts["lp"], n, LONG, logprobs=K, prompt_logprobs=K),
        Join("chosen", prompts["lp"], n, LONG, logprobs=0),
        Join("plain", prompts["plain"], n, LONG),
        Join("echo", prompts["echo"], 0, LONG, logprobs=K, prompt_logprobs=K),
    ]
    ids, tokens, prompt_lps = drain_logprobs(batch, joins)
    assert {k: len(v) for k, v in ids.items()} == {"lp": n, "chosen": n, "plain": n, "echo": 0}
    assert set(tokens) == {"lp", "chosen"} and set(prompt_lps) == {"lp", "echo"}  # plain asked nothing

    own_ids, own_tokens, own_prompt = vllm_own(backend, prompts["lp"], n, K)
    assert ids["lp"] == own_ids == ids["chosen"]
    assert_positions_close(tokens["lp"], own_tokens, "tokens vs vLLM's own")
    assert_positions_close(prompt_lps["lp"], own_prompt, "prompt vs vLLM's own")

    forward = hf_positions(hf_model, prompts["lp"] + ids["lp"], K)
    assert_positions_close(prompt_lps["lp"], forward[: len(prompts["lp"]) - 1], "prompt vs transformers")
    assert_positions_close(tokens["lp"], forward[len(prompts["lp"]) - 1 :], "tokens vs transformers")
    assert_positions_close(prompt_lps["echo"], hf_positions(hf_model, prompts["echo"], K), "echo vs transformers")
    # logprobs 0: the chosen token's, no others; equal to the row asking 5.
    assert [t.top for t in tokens["chosen"]] == [()] * n
    assert all(abs(a.logprob - b.logprob) <= ATOL for a, b in zip(tokens["chosen"], tokens["lp"]))


async def test_more_logprobs_than_the_engine_gives_are_refused_naming_the_field(backend):
    assert backend.max_logprobs == 20  # vLLM's default max_logprobs
    assert await backend.check(LONG, logprobs=20, prompt_logprobs=20) == LONG
    for asked in ({"logprobs": 21}, {"prompt_logprobs": 21}):
        with pytest.raises(EngineRefused) as e:
            await backend.check(None, **asked)
        assert e.value.field == "logprobs" and e.value.status == 400 and "at most 20" in e.value.message


def test_rows_asking_logprobs_vllm_cannot_give_fail_alone(backend):
    # On an engine of a lower max_logprobs, a row asking more fails alone at its join; a
    # prefill-only row filling the whole context fails alone too (vLLM runs it with one
    # token, and refuses a prompt that leaves none: a 400 naming the prompt, as vllm serve
    # answers echo with max_tokens 0 there). The row beside them runs to its end.
    ids = backend.text.encode("Hello!", 0)
    full = (ids * 512)[:512]
    kept, backend.max_logprobs = backend.max_logprobs, 3
    try:
        batch = backend.open_batch()
        joins = [Join("ok", ids, 8, LONG, logprobs=3), Join("many", ids, 0, LONG, prompt_logprobs=4)]
        joins.append(Join("full", full, 0, None, prompt_logprobs=1))
        got, failed = [], {}
        for i in range(200):
            out = batch.run_chunk(joins if i == 0 else [], 2)
            assert set(out) <= {"ok", "full"}
            got += out.get("ok", [])
            failed.update(batch.take_failed())
            if not batch.keys():
                break
    finally:
        backend.max_logprobs = kept
    assert len(got) == 8 and set(failed) == {"many", "full"}
    assert isinstance(failed["many"], EngineRefused) and failed["many"].field == "logprobs"
    assert isinstance(failed["full"], EngineRefused) and failed["full"].field == "prompt"


def test_a_repetition_penalty_reaches_the_engine(backend):
    # A strong penalty on the prompt's and the answer's tokens changes greedy tokens.
    ids = backend.text.encode("Hello there, hello there", 32)
    plain, penalised = (
        drain(backend.open_batch(), [[Join(0, ids, 32, RowSampling(ignore_eos=True, repetition_penalty=r))]])[0]
        for r in (1.0, 2.0)
    )
    assert len(plain) == len(penalised) == 32 and penalised != plain


def test_remove_aborts_the_row_and_frees_its_slot(backend):
    ids = backend.text.encode("Stream A keeps going.", 0)
    batch = backend.open_batch()
    batch.run_chunk([Join("a", ids, 400, LONG), Join("b", ids, 400, LONG)], 4)
    for _ in range(20):
        if backend.stats().running == 2:
            break
        batch.run_chunk([], 4)
    assert backend.stats().running == 2
    batch.remove(["b"])
    assert batch.keys() == ["a"]
    for _ in range(1, 6):
        out = batch.run_chunk([], 4)
        assert "b" not in out
        if backend.stats().running == 1:
            break
    assert backend.stats().running == 1, backend.stats()
    batch.remove(batch.keys())
    assert batch.keys() == [] and batch.run_chunk([], 4) == {}


def test_a_request_vllm_refuses_fails_alone_and_the_others_go_on(backend):
    # vLLM's own validation, for one row of a running batch: a prompt id past the vocabulary
    # (its renderer), a schema its xgrammar backend does not serve (SamplingParams' verify).
    # Each fails alone with a 400; the row beside them runs to its max_tokens.
    batch = backend.open_batch()
    ok = backend.text.encode("Hello!", 0)
    allof = RowSampling(
        json_schema=json.dumps({"allOf": [{"type": "string"}, {"enum": ["yes", "no"]}]}), json_schema_of="tools"
    )
    joins = [[Join("ok", ok, 40, LONG)], [Join("bad-id", [10**6], 4, None), Join("bad-schema", ok, 4, allof)]]
    got, failed = [], {}
    for i in range(200):
        out = batch.run_chunk(joins[i] if i < len(joins) else [], 2)
        assert set(out) <= {"ok"}
        got += out.get("ok", [])
        failed.update(batch.take_failed())
        if i >= len(joins) and not batch.keys():
            break
    assert isinstance(failed["bad-id"], EngineRefused) and failed["bad-id"].status == 400
    assert isinstance(failed["bad-schema"], EngineRefused) and failed["bad-schema"].field == "tools"
    assert len(got) == 40
    with pytest.raises(ContextTooLong):
        batch.run_chunk([Join("long", ok * 200, 4, None)], 2)


VERDICT = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green"]}},
    "required": ["ok", "colour"],
    "additionalProperties": False,
}


async def test_a_json_schema_guides_the_answer_to_json_that_follows_it(backend):
    s = RowSampling(temperature=1.0, seed=7, json_schema=json.dumps(VERDICT))
    assert await backend.check(s) == s
    ids = backend.text.encode("Answer in JSON:", 64)
    batch = backend.open_batch()
    got = drain(batch, [[Join(i, ids, 64, s) for i in range(3)]])
    for i in range(3):
        value = json.loads(backend.tokenizer.decode(got[i], skip_special_tokens=True))
        assert set(value) == {"ok", "colour"} and isinstance(value["ok"], bool) and value["colour"] in ("red", "green")
        assert len(got[i]) < 64  # the grammar ended the answer, not max_tokens


async def test_a_schema_vllm_cannot_compile_is_refused_before_the_batch(backend):
    schema = json.dumps({"allOf": [{"type": "string"}, {"enum": ["yes", "no"]}]})
    with pytest.raises(EngineRefused) as e:
        # vLLM knows its xgrammar backend does not serve a multi-branch allOf
        await backend.check(RowSampling(json_schema=schema))
    assert e.value.field == "response_format" and e.value.status == 400
    with pytest.raises(EngineRefused) as e:  # a forced tool call's schema: the refusal names tools
        await backend.check(RowSampling(json_schema=schema, json_schema_of="tools"))
    assert e.value.field == "tools" and e.value.message.startswith("tools: vLLM refuses the JSON schema")
    assert await backend.check(None) is None
    assert await backend.check(LONG) == LONG  # nothing to refuse
    assert (await backend.check(RowSampling(temperature=1.0, top_k=10**9))).top_k is None  # past the vocabulary


async def test_a_schema_slow_to_compile_is_refused_at_its_limit_while_the_replica_serves_others(backend):
    # A nested anyOf whose grammar takes about a second to compile here, with a 50 ms limit:
    # 400 SCHEMA_TOO_COMPLEX for it, while a plain request on the same engine runs to its end
    # (the compile is in a grammar thread, not on the event loop nor the engine's loop).
    import asyncio

    from ballast.errors import SchemaTooComplex
    from ballast.model.grammar import GrammarCompiles
    from tests.unit.test_grammar import nested_any_of

    kept = backend.grammars
    backend._xgrammar()  # built at warmup in a replica
    backend.grammars = GrammarCompiles(backend._compile_schema, threads=1, timeout_s=0.05)
    try:
        batch = backend.open_batch()
        plain = asyncio.ensure_future(
            asyncio.to_thread(drain, batch, [[Join("plain", backend.text.encode("Hello!", 24), 24, LONG)]])
        )
        with pytest.raises(SchemaTooComplex) as e:
            await backend.check(RowSampling(json_schema=nested_any_of(7), json_schema_of="tools"))
        assert e.value.field == "tools" and e.value.status == 400
        assert len((await plain)["plain"]) == 24
        for _ in range(6000):
            if backend.grammars.running == 0:
                break
            await asyncio.sleep(0.01)
    finally:
        backend.grammars.close()
        backend.grammars = kept


async def test_two_slow_schemas_of_one_tenant_leave_another_tenants_answer_within_its_deadline(backend):
    # Through the replica's loop, as Serve calls it: a tenant sends two slow schemas at once
    # (a nested anyOf compiling for seconds here, past the front's node bound: as slow as a
    # schema within the bounds can be on a large vocabulary), with the replica's defaults of
    # 2 threads. Its first is refused at the limit and compiles on, holding the tenant's one
    # thread; its second waits for that thread. Another tenant's structured request is
    # compiled on the other thread and answered, JSON that follows its schema, within its
    # deadline, while the slow compile still runs.
    import asyncio
    import time

    from ballast.errors import SchemaTooComplex
    from ballast.model.grammar import GrammarCompiles
    from ballast.model.protocol import AttemptDeadline, ModelCall
    from ballast.model.replica_loop import ReplicaLoop
    from ballast.policies.scheduler import SchedulerConfig
    from tests.unit.test_grammar import nested_any_of

    kept = backend.grammars
    backend._xgrammar()  # built at warmup in a replica
    backend.grammars = grammars = GrammarCompiles(backend._compile_schema, threads=2, timeout_s=0.5)
    loop = ReplicaLoop(
        backend,
        SchedulerConfig(kv_budget_tokens=8 * 512, context_tokens=512),
        chunk_tokens=4,
        batch_limit=4,
        max_deadline_s=120.0,
        max_tokens_limit=64,
    )

    async def answer(tenant: str, schema: str, deadline_s: float) -> str:
        sampling = RowSampling(temperature=1.0, seed=7, json_schema=schema)
        deadline = AttemptDeadline.starting(deadline_s, time.time())
        call = ModelCall(prompt="Answer in JSON:", max_tokens=64, sampling=sampling, deadline=deadline, tenant=tenant)
        return "".join([chunk.text async for chunk in loop.stream(call)])

    noisy = [asyncio.ensure_future(answer("noisy", nested_any_of(8, leaf), 60.0)) for leaf in ("string", "integer")]
    try:
        with pytest.raises(SchemaTooComplex):
            await noisy[0]
        started = time.monotonic()
        value = json.loads(await answer("quiet", json.dumps(VERDICT), 10.0))
        assert time.monotonic() - started < 10.0
        assert set(value) == {"ok", "colour"} and value["colour"] in ("red", "green")
        # The slow compile is still running on the noisy tenant's thread; its second schema never began.
        assert (grammars.held("noisy"), grammars.compiles, noisy[1].done()) == (1, 2, False)
    finally:
        noisy[1].cancel()
        loop.stop()
        for _ in range(6000):  # the slow compile runs on to its end: at most a minute
            if grammars.running == 0:
                break
            await asyncio.sleep(0.01)
        grammars.close()
        backend.grammars = kept
    assert grammars.running == 0


def test_an_interactive_row_starts_before_batch_rows_waiting_longer_and_those_in_arrival_order(backend):
    # Ballast starts vLLM with scheduling_policy "priority": rows waiting in the engine start
    # by (priority, arrival). Every slot is taken by batch rows, one of them short; two more
    # batch rows wait, then an interactive row (priority 0) arrives. Each slot that frees goes
    # to the interactive row first, then to the waiting batch rows in their arrival order.
    ids = backend.text.encode("Hello!", 0)
    batch = backend.open_batch()
    slots = ENGINE_KWARGS["max_num_seqs"]
    running = [Join(f"run-{i}", ids, 4 if i == 0 else 200, LONG, priority=BATCH_PRIORITY) for i in range(slots)]
    batch.run_chunk(running + [Join(f"wait-{i}", ids, 4, LONG, priority=BATCH_PRIORITY) for i in range(2)], 1)
    joins = [Join("interactive", ids, 4, LONG)]
    first: dict[str, int] = {}  # the chunk each row had its first ids in
    for chunk in range(100):
        if {"wait-0", "wait-1", "interactive"} <= first.keys():
            break
        for key, new in batch.run_chunk(joins, 1).items():
            if new:
                first.setdefault(key, chunk)
        joins = []
    batch.remove(batch.keys())
    assert first["interactive"] < first["wait-0"] < first["wait-1"], first


def test_the_model_benchmark_drives_vllm_as_the_replica_does(backend):
    # make bench-model's vllm rows: closed-loop clients, rows to their max_tokens, the
    # short request beside long ones; the long rows are taken out of the engine after.
    import itertools

    from loadtest import bench_model as bm

    counter = itertools.count()
    clock = lambda: float(next(counter))  # noqa: E731 - a tick per read: no timing here
    requests = bm.workload(4, 12, seed=0)
    run = bm.run_ballast(backend, requests, 2, 4, clock, stack="vllm", sampling=LONG)
    assert (run.stack, run.tokens, len(run.latencies_s)) == ("vllm", sum(r.max_tokens for r in requests), 4)
    short = bm.short_beside_long_ballast(backend, 1, [12], bm.PROMPTS[4], 2, 4, 0, clock, stack="vllm", sampling=LONG)
    assert short.stack == "vllm" and len(short.alone_s) == len(short.beside_s) == 2


def test_prefix_cache_hits_for_a_repeated_long_prompt(backend):
    ids = backend.text.encode(" ".join(PROMPTS) * 8, 0)[:300]  # more than two KV blocks of 128
    before = backend.stats()
    drain(backend.open_batch(), [[Join(0, ids, 2, LONG)]])
    drain(backend.open_batch(), [[Join(0, ids, 2, LONG)]])
    after = backend.stats()
    assert after.prefix_cache_queries - before.prefix_cache_queries >= 2 * len(ids)
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 256
    assert 0.0 <= after.kv_cache_usage <= 1.0 and after.steps > before.steps


def test_the_blocks_vllm_caches_are_reported_under_the_keys_a_router_computes(backend):
    # The contract between vLLM's KV events (replica) and block_keys (router): a prompt the
    # engine ran is held, block for block, under the keys a router computes from its ids.
    import time

    from ballast.policies.prefix_cache import PrefixReport, block_keys, matched_blocks

    ids = backend.text.tokenize(" ".join(reversed(PROMPTS)) * 8)[:300]
    size = backend.describe()["kv_block_size"]
    keys = block_keys(ids, size)
    assert matched_blocks(keys, backend.prefix_report(time.time()).keys) == 0
    drain(backend.open_batch(), [[Join(0, ids, 2, LONG)]])
    deadline = time.monotonic() + 10  # the events cross from the engine's process on its own socket
    while matched_blocks(keys, backend.prefix_report(time.time()).keys) < len(keys) and time.monotonic() < deadline:
        time.sleep(0.05)
    report = backend.prefix_report(time.time())
    assert isinstance(report, PrefixReport) and report.block_size == size
    assert matched_blocks(keys, report.keys) == len(keys) == 300 // size
    other = block_keys(backend.text.tokenize("something else entirely " * 40)[:300], size)
    assert matched_blocks(other, report.keys) == 0


def cached_at_first_tokens(backend, ids, salt):
    """How many of ``ids`` vLLM took from its prefix cache for a row of cache salt ``salt``
    (the batch's word at the row's first tokens); the row is run to its end."""
    batch = backend.open_batch()
    out = batch.run_chunk([Join(0, ids, 2, LONG, cache_salt=salt)], 4)
    while not out.get(0):
        assert batch.keys(), "the row ended with no tokens"
        out = batch.run_chunk([], 4)
    cached = batch.cached_tokens(0)
    drain(batch, [])
    return cached


def test_a_cache_salt_keeps_two_groups_apart_in_vllms_prefix_cache_and_in_its_report(backend):
    # Two cache groups (two salts) send one prompt: each hits only its own blocks, and the
    # replica reports each group's blocks under the keys a router computes for that group.
    import time

    from ballast.policies.prefix_cache import block_keys, matched_blocks

    ids = backend.text.tokenize("salted " + " ".join(PROMPTS) * 8)[:300]
    size = backend.describe()["kv_block_size"]
    full = (len(ids) // size) * size
    assert cached_at_first_tokens(backend, ids, "group-a") == 0  # a new prompt
    assert cached_at_first_tokens(backend, ids, "group-a") == full  # its own group's blocks
    assert cached_at_first_tokens(backend, ids, "group-b") == 0  # the other group's: none
    assert cached_at_first_tokens(backend, ids, None) == 0  # nor a call with no group
    keys = {salt: block_keys(ids, size, None, salt) for salt in ("group-a", "group-b", None)}
    deadline = time.monotonic() + 10  # the events cross from the engine's process on its own socket
    while matched_blocks(keys["group-b"], backend.prefix_report(time.time()).keys) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    held = backend.prefix_report(time.time()).keys
    assert [matched_blocks(keys[s], held) for s in ("group-a", "group-b", None)] == [2, 2, 2]
    assert len({k[0] for k in keys.values()}) == 3  # three groups, three chains


def test_the_salt_is_read_from_vllms_own_event_after_the_adapters_name():
    from vllm.distributed.kv_events import BlockStored

    from ballast.model.kv_events import first_block_salt

    def event(lora, extra):
        return BlockStored([1, 2], None, list(range(8)), 4, None, "GPU", lora, extra_keys=extra)

    assert first_block_salt(event(None, None)) is None
    assert first_block_salt(event(None, [None, None])) is None
    assert first_block_salt(event(None, [("s1",), None])) == "s1"
    assert first_block_salt(event("sql", [("sql",), ("sql",)])) is None  # the adapter's name is no salt
    assert first_block_salt(event("sql", [("sql", "s1"), ("sql",)])) == "s1"
    assert first_block_salt(event(None, [(("mm-1", 0), "s1", b"digest"), None])) == "s1"


def test_a_bad_directory_fails_at_construction(tmp_path, ckpt):
    with pytest.raises(ModelLoadError) as e:
        VLLMBackend(str(tmp_path / "missing"), name="x", engine_kwargs=ENGINE_KWARGS)
    assert str(tmp_path / "missing") in str(e.value)
    # The files are fine for transformers; vLLM refuses the context asked for, naming config.json.
    with pytest.raises(ModelLoadError) as e:
        VLLMBackend(str(ckpt), name="x", engine_kwargs={**ENGINE_KWARGS, "max_model_len": 100_000})
    assert e.value.path == os.path.join(str(ckpt), "config.json")
    assert "100000" in e.value.reason


def test_a_live_engine_reports_its_step_curve(backend):
    """One row then eight, 40 tokens each: vLLM's steps reach the curve and its useful rows."""
    ids = backend.text.encode("Hello!", 0)
    for rows in (1, 8):
        batch = backend.open_batch()
        joins = [Join(f"r{rows}-{i}", ids, 40, LONG) for i in range(rows)]
        while joins or batch.keys():
            batch.run_chunk(joins, 4)
            joins = []
    curve = backend._stats.curve()
    assert curve["step_base_ms"] is not None and curve["step_per_row_ms"] is not None
    assert backend.stats().useful_rows == curve["rows"]


def test_the_replica_reads_vllms_own_view_where_the_engine_table_says_it_has_one(backend):
    # vLLM's row: it schedules itself and reports its prefix cache's blocks, so the replica
    # reads its stats and its report (the built-in side: test_model_server_parts.py); LoRA is
    # off in this engine, so it has no slots to mirror.
    import time

    from ballast.model.server import ModelServer
    from ballast.policies.prefix_cache import PrefixReport

    server = ModelServer.__new__(ModelServer)  # only the backend is read
    server._backend = backend
    assert isinstance(server._engine_stats(), VLLMStats)
    assert isinstance(server._prefix_report(time.time()), PrefixReport)
    assert backend.lora_slots == 0 and server._adapter_holdings().slots == 0
    assert server._engine_lost() is None
    assert sorted(name for _, name in server._engine_processes()) == ["VLLM::EngineCore", "VLLM::Worker"]


async def test_the_replica_loop_names_vllms_log_probabilities_and_answers_n_choices(backend):
    from ballast.model.protocol import ModelCall
    from ballast.model.replica_loop import ReplicaLoop
    from ballast.policies.scheduler import SchedulerConfig

    loop = ReplicaLoop(
        backend,
        SchedulerConfig(kv_budget_tokens=None, context_tokens=512),
        chunk_tokens=4,
        batch_limit=8,
        max_deadline_s=60.0,
        max_tokens_limit=64,
    )
    ids = tuple(backend.text.tokenize(PROMPTS[0]))
    ask = {"prompt": PROMPTS[0], "prompt_ids": ids, "tokenizer": backend.tokenizer_id, "max_tokens": 5}
    chunks = [c async for c in loop.stream(ModelCall(**ask, logprobs=3, prompt_logprobs=2, n=2))]
    for i in (0, 1):
        mine = [c for c in chunks if c.index == i]
        got = [lp for c in mine for lp in c.logprobs]
        assert len(got) == sum(len(c.ids) for c in mine) == 5 and all(len(lp.top) == 3 for lp in got)
        assert [lp.token for lp in got] == backend.text.token_texts([t for c in mine for t in c.ids])
        (prompt,) = [c.prompt_logprobs for c in mine if c.prompt_logprobs is not None]
        assert len(prompt) == len(ids) and prompt[0].logprob is None and all(len(p.top) == 2 for p in prompt[1:])
    (alone,) = [c async for c in loop.stream(ModelCall(**{**ask, "max_tokens": 0}, prompt_logprobs=0))]
    assert (alone.ids, alone.finish_reason) == ((), "length") and len(alone.prompt_logprobs) == len(ids)
    loop.stop()


def test_engine_processes_live_then_gone_after_shutdown(backend):
    """Runs last in the module: it shuts the module's engine down."""
    pids = backend.engine_pids()
    assert len(pids) >= 1
    # What the replica hands its watchdog: vLLM's own processes, by the titles vLLM gives them.
    named = dict(backend.engine_processes())
    assert sorted(named.values()) == ["VLLM::EngineCore", "VLLM::Worker"] and set(named) <= set(pids)
    assert backend.lost is None
    for pid in pids:
        p = psutil.Process(pid)
        assert p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        assert pid != os.getpid()
    backend.shutdown()
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == []
    with pytest.raises(RuntimeError):
        backend.open_batch().run_chunk([Join(0, [1, 2], 2)], 2)
    backend.shutdown()  # idempotent


def test_a_chunk_ends_when_a_row_has_its_first_tokens_not_after_a_whole_chunk():
    """Rule by rule on rows as the pumps leave them (no engine): a new row's first token
    ends the chunk (its time to first token is vLLM's, not vLLM's plus a chunk); then the
    chunk waits for ``steps`` unread from every row that makes tokens."""
    from ballast.model.protocol import GREEDY
    from ballast.model.vllm_batch import Row, chunk_ready

    def row(unread: int, made: int, finished: bool = False) -> Row:
        r = Row(0, "r", GREEDY)
        r.unread, r.made, r.finished = [7] * unread, made, finished
        return r

    assert chunk_ready([row(0, 10), row(1, 1)], 4)  # the new row's first token
    assert not chunk_ready([row(2, 10), row(1, 3)], 4)  # its first tokens went out already: a whole chunk
    assert not chunk_ready([row(4, 10), row(2, 6)], 4)  # one row short of 4
    assert chunk_ready([row(4, 10), row(4, 6)], 4)
    assert chunk_ready([row(4, 10), row(0, 0)], 4)  # a row still queued in vLLM does not hold the others
    assert chunk_ready([row(1, 11, finished=True), row(4, 8)], 4)


def test_the_engines_steps_give_its_curve_by_vllms_own_inter_token_gaps():
    """Step by step as vLLM's stat loggers get them (no engine): the rows scheduled and the
    rows' inter-token gaps, whose median is the step's time; a step with no gap (every row
    new) says nothing of it. The useful rows are the curve's."""
    from vllm.v1.metrics.stats import SchedulerStats

    from ballast.model.vllm_stats import StatsSink
    from ballast.policies.engines import StepCurve

    sink, curve = StatsSink(), StepCurve()
    for _ in range(8):
        for rows in range(1, 17):
            step = 0.004 + 0.0005 * rows
            gaps = [step] * rows if rows < 3 else [step] * (rows - 1) + [0.9]  # one row of many waited
            sink.record(SchedulerStats(num_running_reqs=rows), gaps)
            curve.observe(rows, step)
            sink.record(SchedulerStats(num_running_reqs=rows), [])  # new rows only: no step time
    assert sink.curve() == curve.snapshot() and curve.rows() == 46
    assert (sink.get().running, sink.get().useful_rows, sink.get().steps) == (16, 46, 256)


def test_a_vllm_position_becomes_the_chosen_ids_logprob_and_the_k_likeliest_by_rank():
    """vLLM's position dicts as its output processor builds them (no engine): the chosen id
    first with its own rank, then the k of rank 1..k; a chosen id among them carries its
    rank there."""
    from vllm.logprobs import Logprob

    from ballast.model.vllm_batch import position_logprobs

    outside = {9: Logprob(-4.0, rank=7), 3: Logprob(-0.5, rank=1), 5: Logprob(-1.5, rank=2)}
    got = position_logprobs(9, outside, 2)
    assert (got.id, got.logprob, got.top) == (9, -4.0, ((3, -0.5), (5, -1.5)))
    among = {5: Logprob(-1.5, rank=2), 3: Logprob(-0.5, rank=1), 8: Logprob(-2.0, rank=3)}
    assert position_logprobs(5, among, 3).top == ((3, -0.5), (5, -1.5), (8, -2.0))
    assert position_logprobs(5, among, 0).top == () and position_logprobs(5, among, 0).logprob == -1.5
