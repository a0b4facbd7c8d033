"""A small Hugging Face causal-LM directory with random weights, built here, downloading nothing.

For tests (``make_tiny_llama``: a few thousand parameters, built in well under a
second) and for newcomers with no weights at hand (``make demo-model``, i.e.
``python -m ballast.model.demo DIR``: a few million). Either writes what a team would bring: a Llama-architecture
``config.json``, safetensors weights (one file, or an index and shards), a
byte-level BPE tokenizer with bos/eos/pad tokens and a Jinja chat template, all
through ``save_pretrained`` so the layout is exactly what transformers writes.

The tokenizer is trained here with the ``tokenizers`` package on a small
built-in corpus, and the weights are random from a fixed seed: the directory
is byte-for-byte reproducible and takes well under a second to build.

The weights are drawn wider than Llama's training init (``initializer_range``
0.2, not 0.02): with the training init an untrained model's logits are nearly
flat and greedy decoding repeats one token whatever the prompt, so a test that
batching or the KV cache is right would pass vacuously. At 0.2 greedy output
depends on the prompt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypedDict

__all__ = [
    "CHAT_TEMPLATE",
    "CORPUS",
    "DEMO_GEOMETRY",
    "FAMILIES",
    "SEED",
    "VLLM_GEOMETRY",
    "make_llama",
    "make_tiny_llama",
    "train_tokenizer",
]

SEED = 1234

# Plain ASCII and a little multi-byte text (so streaming tests can cut a
# character in two), chat-shaped lines so the template's markers become merges.
CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "A replica serves requests; the router sends each one to the least loaded replica.",
    "Tokens per second, time to first token, and the p99 latency of short requests.",
    "The KV cache grows by one token per step for every row in the running batch.",
    "Hello! How are you today? I am fine, thank you.",
    "<|system|>\nYou are a helpful assistant.",
    "<|user|>\nWhat is the capital of France?",
    "<|assistant|>\nThe capital of France is Paris.",
    "Café, naïve, über, 東京, Ελληνικά, emoji 🙂 and more.",
    "def add(a, b):\n    return a + b\n",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000",
)

BOS, EOS, PAD = "<s>", "</s>", "<pad>"

# Jinja, in the shape real templates have: bos once, a role marker per message,
# eos after each turn, and the assistant marker when a reply is asked for. Tools as
# Hermes-style templates (Qwen2.5, Hermes 2 Pro) show them, so that vLLM's ``hermes``
# tool parser reads the calls: the tools listed in a system turn first, an assistant's
# calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, a tool's result
# as a turn of role tool. Without tools the text is what it always was.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "<tool_call>{\"name\": {{ call['function']['name'] | tojson }}, "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}</tool_call>{% endfor %}{% endif %}"
    "{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# A second family, Llama 3.1's JSON tool calling (vLLM's ``llama3_json`` parser reads it):
# header markers around each role, ``<|eot_id|>`` after each turn, the tools in the system
# turn, an assistant's call as ``{"name": ..., "parameters": {...}}``, a tool's result as a
# turn of role ``ipython``; ``<|python_tag|>`` is in the vocabulary as the parser requires.
# And thinking as Qwen3's templates write it for a reasoning parser (``deepseek_r1``): the
# generation prompt opens ``<think>``, or with ``enable_thinking: false`` writes it closed.
# ``<think>`` and ``</think>`` are whole tokens but not special ones (as in Qwen3's and R1's
# vocabularies): an answer's text keeps them, where a parser reads them.
LLAMA3_SPECIAL = ("<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>")
THINK_TOKENS = ("<think>", "</think>")
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% set header = '<|start_header_id|>{}<|end_header_id|>\n\n' %}"
    "{% if tools %}{{ header.format('system') }}You may call these functions, answering with a JSON object "
    '{"name": function name, "parameters": its arguments}:\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for message in messages %}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}{{ header.format('assistant') }}"
    "{% for call in message['tool_calls'] %}"
    '{"name": {{ call.function.name | tojson }}, "parameters": {{ call.function.arguments | tojson }}}'
    "{% endfor %}<|eot_id|>"
    "{% else %}{{ header.format('ipython' if message['role'] == 'tool' else message['role']) }}"
    "{{ message['content'] or '' }}<|eot_id|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ header.format('assistant') }}"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)
FAMILIES = {  # family: (bos, eos, pad, other special tokens, chat template)
    "hermes": (BOS, EOS, PAD, (), CHAT_TEMPLATE),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>", LLAMA3_SPECIAL, LLAMA3_TEMPLATE),
}
WORD_TOKENS = {  # family: whole tokens that are text, not special
    "llama3": THINK_TOKENS,
}

_TARGET_VOCAB = 384


def train_tokenizer(*, chat_template: bool = True, context: int = 128, family: str = "hermes") -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on :data:`CORPUS`, with the
    special tokens and chat template of ``family`` (:data:`FAMILIES`).

    Byte-level, so any text encodes (no unknown token) and decoding is exact.
    Encoding adds the bos in front, as Llama's tokenizer does.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from ballast.model.untyped import transformers

    bos, eos, pad, special, template = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TARGET_VOCAB,
        special_tokens=[bos, eos, pad, *special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in WORD_TOKENS.get(family, ())])
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )
    return transformers().PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        additional_special_tokens=list(special) or None,
        padding_side="left",
        model_max_length=context,  # the config's max_position_embeddings
        chat_template=template if chat_template else None,
    )


def _shard_size_bytes(model: Any, shards: int) -> int:
    """The smallest ``max_shard_size`` for which ``save_pretrained`` writes ``shards`` files.

    save_pretrained packs tensors with huggingface_hub's
    ``split_torch_state_dict_into_shards`` (next-fit in state-dict order, whose
    file count only falls as the size limit grows), so a bisection on that same
    function finds the size; it only reads tensor sizes, nothing is written.
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    state = model.state_dict()

    def count(size: int) -> int:
        return len(split_torch_state_dict_into_shards(state, max_shard_size=size).filename_to_tensors)

    lo, hi = 1, sum(t.numel() * t.element_size() for t in state.values())
    while lo < hi:  # smallest size with count(size) <= shards
        mid = (lo + hi) // 2
        if count(mid) <= shards:
            hi = mid
        else:
            lo = mid + 1
    if count(lo) != shards:
        raise ValueError(f"cannot split the model's {len(state)} tensors into exactly {shards} shards")
    return lo


# Geometry of ``make tiny`` (tests) and of ``make demo-model``.
class Geometry(TypedDict):
    """A Llama's shape, as ``make_llama`` takes it."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    context: int


TINY_GEOMETRY = Geometry(hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, context=128)
DEMO_GEOMETRY = Geometry(
    hidden=256, intermediate=688, layers=4, heads=4, kv_heads=2, context=1024
)  # head size 64: vLLM serves it too
# The smallest model the vLLM engine's tests serve: head size 64 is one vLLM's CPU attention supports.
VLLM_GEOMETRY = Geometry(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, context=512)


def make_tiny_llama(dir: Path, *, shards: int = 1, chat_template: bool = True) -> Path:
    """Write a tiny random Llama checkpoint and its tokenizer into ``dir``; return ``dir``.

    Hidden 32, 2 layers, 4 heads (2 KV heads, so grouped-query attention is
    exercised), context 128, vocabulary the tokenizer's. ``shards > 1`` writes
    ``model.safetensors.index.json`` and exactly that many shard files.
    ``chat_template=False`` leaves the template out.
    """
    return make_llama(dir, shards=shards, chat_template=chat_template, **TINY_GEOMETRY)


def make_llama(
    dir: Path,
    *,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    context: int,
    shards: int = 1,
    chat_template: bool = True,
    family: str = "hermes",
) -> Path:
    """Write a random Llama checkpoint of this geometry and its tokenizer (of ``family``'s
    special tokens and chat template, :data:`FAMILIES`) into ``dir``."""
    import torch
    from transformers import LlamaConfig

    from ballast.model.untyped import transformers

    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        raise ValueError(f"shards must be an int >= 1, got {shards!r}")
    dir = Path(dir)
    tokenizer = train_tokenizer(chat_template=chat_template, context=context, family=family)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context,
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    # fork_rng: seed the init without disturbing the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = transformers().LlamaForCausalLM(config).eval()
    model.generation_config = transformers().GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    max_shard_size = _shard_size_bytes(model, shards) if shards > 1 else "1GB"
    dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dir, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(dir)
    if shards > 1:
        index = json.loads((dir / "model.safetensors.index.json").read_text())
        written = set(index["weight_map"].values())
        if len(written) != shards:  # the bisection above mirrors save_pretrained; check it did
            raise AssertionError(f"wanted {shards} shards, save_pretrained wrote {sorted(written)}")
    return dir


# The Llama projections an adapter changes (every one vLLM's LoRA layers take).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora_adapter(base_dir: Path, out_dir: Path, seed: int, r: int = 8) -> Path:
    """Write a random LoRA adapter of rank ``r`` for the Llama in ``base_dir`` into
    ``out_dir`` (PEFT's ``adapter_config.json`` and ``adapter_model.safetensors``); return
    ``out_dir``. ``init_lora_weights=False`` draws both matrices at random (PEFT's default
    zeroes B, which changes nothing), so each ``seed`` gives its own output. Needs
    ``peft`` (the ``test`` extra, which ``make install`` installs)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype="float32")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = LoraConfig(r=r, lora_alpha=2 * r, init_lora_weights=False, target_modules=list(LORA_TARGETS))
        peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(str(out_dir))
    return Path(out_dir)


def _no_write_for_others(*paths: Path) -> None:
    """Take the group's and others' write bits off ``paths``: a replica loads an adapter
    added at run time only from where no one but its user (or root) may write
    (``adapters_root``), whatever the umask that wrote them."""
    for p in paths:
        p.chmod(p.stat().st_mode & 0o7755)


def main(argv: list[str] | None = None) -> int:
    """``python -m ballast.model.demo DIR``: write the demo model (``make demo-model``)."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="where to write the checkpoint (created if missing)")
    parser.add_argument(
        "--adapters",
        default="",
        help="comma-separated names: a random LoRA adapter for each, written beside it as DIR-<name>",
    )
    args = parser.parse_args(argv)
    if not (args.dir / "config.json").exists():
        make_llama(args.dir, **DEMO_GEOMETRY)
        print(f"wrote a random-weight Llama ({DEMO_GEOMETRY}) to {args.dir}")
    names = [n for n in args.adapters.split(",") if n]
    for seed, name in enumerate(names, start=1):
        out = args.dir.parent / f"{args.dir.name}-{name}"
        make_lora_adapter(args.dir, out, seed)
        _no_write_for_others(out, *out.iterdir())
        print(f"wrote LoRA adapter {name!r} (rank 8) to {out}")
    if names:  # the adapters_root of cluster/local-models.yaml holds them
        _no_write_for_others(args.dir.parent)
    print(f"serve it with: make serve MODEL={args.dir}  (or: ballast serve --model {args.dir})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
