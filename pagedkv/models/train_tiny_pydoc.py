"""Train the `tiny-pydoc` preset: a small byte-level Llama on Python's own documentation.

The text is `pydoc_data.topics.topics` (the reference-manual topics that `help("for")` prints),
which ships with every CPython, so nothing is downloaded. Each topic becomes
`[BOS] utf-8 bytes [EOS]`; topics are taken in sorted-key order and every tenth one (index 5,
15, ...) is held out for validation. Training draws random windows from the other topics with
a seeded generator, so the same command gives the same weights on the same device and
library versions. The defaults are the shipped preset's (about a minute on an H200; hours on
two CPU cores):

    python -m pagedkv.models.train_tiny_pydoc --out pagedkv/models/data/tiny-pydoc

Each Python release has its own edition of the topics, and the tests recompute the held-out
loss from the topics of the Python they run on. To train on a machine with another Python
than the tests', dump the topics where the tests run and train on that file:

    python -m pagedkv.models.train_tiny_pydoc --dump-topics build/topics.json      # CI's Python
    python -m pagedkv.models.train_tiny_pydoc --topics build/topics.json --out ...  # the GPU machine

The output directory is a Hugging Face checkpoint (`config.json`, `model.safetensors`,
`tokenizer.json`, ...) that `transformers.AutoModelForCausalLM` and `pagedkv.LLM` both load,
plus `training_log.json` (loss curve, held-out loss, command, seed, wall time, device).
Training uses transformers' `LlamaForCausalLM`: pagedkv's model serves, it does not train.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # for annotations only: transformers is imported where a model is built (`--dump-topics` needs none)
    from transformers import LlamaForCausalLM

BOS_ID, EOS_ID = 256, 257
VOCAB_SIZE = 258  # 256 bytes + BOS + EOS, the ids of pagedkv's ByteTokenizer
VAL_EVERY, VAL_OFFSET = 10, 5  # sorted topic i is held out when i % 10 == 5

FIXED_SHAPE: dict[str, Any] = dict(
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
"""The parts of the model's shape that the command line does not change."""


def pydoc_topics(path: Path | None = None) -> tuple[dict[str, str], str]:
    """(topics, the Python version they come from): this interpreter's, or a `--dump-topics` file.

    Each Python release ships its own edition of the topics; training on one machine for the
    tests of another (CI runs another Python than the GPU machine) needs the same edition.
    """
    if path is None:
        from pydoc_data.topics import topics

        return dict(topics), "%d.%d" % sys.version_info[:2]
    data = json.loads(path.read_text())
    return data["topics"], data["python"]


def pydoc_splits(topics: dict[str, str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) token streams: each topic as [BOS] bytes [EOS], in sorted-key order."""
    train: list[int] = []
    val: list[int] = []
    for i, key in enumerate(sorted(topics)):
        doc = [BOS_ID, *topics[key].encode("utf-8"), EOS_ID]
        (val if i % VAL_EVERY == VAL_OFFSET else train).extend(doc)
    return torch.tensor(train), torch.tensor(val)


def hf_config(args: argparse.Namespace) -> Any:
    """The transformers `LlamaConfig` of `tiny-pydoc`, shaped by the command line."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        **FIXED_SHAPE,
    )


@torch.no_grad()
def held_out_loss(model: LlamaForCausalLM, val: torch.Tensor, seq_len: int) -> float:
    """Mean next-token cross entropy (nats per byte) over the whole held-out stream.

    The stream is cut into consecutive windows of `seq_len + 1` tokens that overlap by one, so
    every token after the first is predicted exactly once; the last window may be shorter.
    """
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(val) - 1, seq_len):
        window = val[start : start + seq_len + 1].to(model.device)
        logits = model(input_ids=window[None, :-1]).logits[0].float()
        total += torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum").item()
        count += len(window) - 1
    model.train()
    return total / count


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup to `peak`, then cosine decay to a tenth of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def train(args: argparse.Namespace) -> tuple[LlamaForCausalLM, dict[str, Any]]:
    """Train from scratch; returns the model and the log that `training_log.json` records."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    topics, topics_python = pydoc_topics(args.topics)
    train_ids, val_ids = pydoc_splits(topics)
    # transformers wraps `to` with functools.wraps, whose typeshed stub does not bind `self`: mypy takes `device` for it.
    model: LlamaForCausalLM = LlamaForCausalLM(hf_config(args)).to(device)  # type: ignore[arg-type]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    data_gen = torch.Generator().manual_seed(args.seed)  # window order: independent of the model
    curve: list[dict[str, float]] = []
    t0, running = time.perf_counter(), 0.0
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        starts = torch.randint(0, len(train_ids) - args.seq_len - 1, (args.batch_size,), generator=data_gen)
        batch = torch.stack([train_ids[s : s + args.seq_len + 1] for s in starts.tolist()]).to(device)
        # HF shifts the labels itself, so this trains on seq_len - 1 predictions per window (the
        # window's last byte is drawn but unused; kept as is: it is what made the shipped weights).
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running += loss.item()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            n = (step % args.log_every) + 1
            point = {
                "step": step + 1,
                "train_loss": running / n,
                "val_loss": held_out_loss(model, val_ids, args.seq_len),
                "wall_s": time.perf_counter() - t0,
            }
            curve.append(point)
            print(json.dumps(point), flush=True)
            running = 0.0
    log = {
        "command": "python -m pagedkv.models.train_tiny_pydoc " + " ".join(sys.argv[1:]),
        "seed": args.seed,
        "device": str(device),
        "torch": torch.__version__,
        "topics_python": topics_python,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "warmup": args.warmup,
        "train_tokens": len(train_ids),
        "val_tokens": len(val_ids),
        "parameters": sum(p.numel() for p in model.parameters()),
        "wall_s": round(time.perf_counter() - t0, 1),
        "val_loss": curve[-1]["val_loss"],
        "curve": curve,
    }
    return model, log


def _byte_chars() -> list[str]:
    """The printable character that the ByteLevel pre-tokenizer writes for each byte 0-255.

    Bytes that are already visible Latin-1 characters stand for themselves; the 68 others
    (controls, space, soft hyphen, ...) take code points 256, 257, ... in byte order.
    """
    visible = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, extra = [], 0
    for b in range(256):
        if b in visible:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def byte_tokenizer_json() -> dict[str, Any]:
    """A `tokenizers` file that encodes exactly as ByteTokenizer: BOS, then one id per UTF-8 byte.

    The ByteLevel pre-tokenizer (no regex split, no prefix space) turns each byte into one
    printable character; a BPE model without merges maps character `_byte_chars()[b]` to id b;
    the ByteLevel decoder turns the characters back into bytes.
    """
    vocab = {c: b for b, c in enumerate(_byte_chars())}
    vocab.update({"<s>": BOS_ID, "</s>": EOS_ID})
    special = [
        {
            "id": i,
            "content": c,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for c, i in (("<s>", BOS_ID), ("</s>", EOS_ID))
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    bos = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": special,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "decoder": byte_level,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [BOS_ID], "tokens": ["<s>"]}},
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
"""tiny-pydoc's chat template (Jinja, as Hugging Face tokenizers keep one)."""


def write_tokenizer(out: Path) -> None:
    """`tokenizer.json` + `tokenizer_config.json` + `special_tokens_map.json` for AutoTokenizer."""
    (out / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json(), indent=1, ensure_ascii=False) + "\n")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,
        "model_max_length": FIXED_SHAPE["max_position_embeddings"],
        # For `pagedkv serve`'s /v1/chat/completions: "role: content" lines, then the assistant's cue
        # (the model was trained on plain text, so this is a format, not a skill it learned).
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="directory to write the checkpoint to")
    parser.add_argument("--topics", type=Path, help="train on the topics in this --dump-topics file")
    parser.add_argument("--dump-topics", type=Path, help="write this Python's topics to a file, then stop")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--intermediate-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=250)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.dump_topics:
        topics, python = pydoc_topics()
        args.dump_topics.write_text(json.dumps({"python": python, "topics": topics}))
        return
    if args.out is None:
        parser.error("--out is required to train")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, log = train(args)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    write_tokenizer(args.out)
    (args.out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(
        f"held-out loss {log['val_loss']:.4f} nats/byte after {log['steps']} steps, {log['wall_s']} s; saved to {args.out}"
    )


if __name__ == "__main__":
    main()
