"""A small Qwen2 GGUF written here, shaped like Qwen2.5-Coder-1.5B-Instruct's Q4_K_M file: the
`qwen2` architecture with q/k/v biases, an output tensor of its own beside the token embedding,
K-quant tensors (Q4_K, Q6_K) where the real file has them, a few other types (Q8_0, Q5_0, F16,
F32), a byte-level BPE vocabulary trained with Qwen2's pre-tokenizer on the shipped sample
prompts, Qwen's control tokens, `<|im_end|>` as eos and the real file's chat template.

gguf-py cannot quantize to K-quants, so those tensors are random blocks with their scales set
so that the weights come out O(1/sqrt(fan_in)): valid blocks that every reader decodes alike.

`install_parts` ships such a file the way the real model ships, as `multipart://` parts inside
packages on sys.path.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from tasks.target.tiny import collect_sample_text

FIXTURES = Path(__file__).parent / "fixtures"
# tokenizer.chat_template of the real Qwen2.5-Coder-1.5B-Instruct GGUF, byte for byte.
CHAT_TEMPLATE = (FIXTURES / "qwen2.5-coder-chat-template.jinja").read_text(encoding="utf-8")
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<tool_call>", "</tool_call>"]
QK_K = 256  # a K-quant block holds 256 weights: every K-quant row is a multiple of it
PARTS = 3  # what install_parts cuts a file into


def train_vocab(vocab_size: int) -> tuple[list[str], list[str]]:
    """(tokens in id order, merges as "a b") of a BPE trained with Qwen2's pre-tokenizer."""
    import json

    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(collect_sample_text(), trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def _k_quant(rng: np.random.Generator, rows: int, cols: int, kind: str, std: float) -> np.ndarray:
    """Random Q4_K / Q6_K blocks [rows, bytes per row] whose weights have about this std."""
    blocks = cols // QK_K
    if kind == "Q4_K":  # d f16, dmin f16, scales[12], qs[128]: w = d*sc*q - dmin*m
        data = rng.integers(0, 256, (rows, blocks, 144), dtype=np.uint8)
        d = np.float16(std / 190.0)
        data[..., 0:2] = np.frombuffer(d.tobytes(), np.uint8)
        data[..., 2:4] = np.frombuffer(np.float16(float(d) * 7.5).tobytes(), np.uint8)
    else:  # Q6_K: ql[128], qh[64], scales int8[16], d f16: w = d*scale*(q - 32)
        data = rng.integers(0, 256, (rows, blocks, 210), dtype=np.uint8)
        data[..., 208:210] = np.frombuffer(np.float16(std / 1370.0).tobytes(), np.uint8)
    return data.reshape(rows, -1)


def write_tiny_qwen2_gguf(
    path: Path,
    *,
    seed: int = 0,
    layers: int = 8,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 512,
    vocab_size: int = 1024,
    context_length: int = 4096,
) -> Path:
    """Write the GGUF to `path` (deterministic for a seed) and return it. Layer counts of 8 or
    more give EAGLE-3 three distinct aux layers."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    tokens, merges = train_vocab(vocab_size - len(CONTROL) - len(USER_DEFINED))
    types = [1] * len(tokens)  # NORMAL
    for group, kind in ((CONTROL, 3), (USER_DEFINED, 4)):
        tokens += group
        types += [kind] * len(group)
    while len(tokens) % 64:  # the real vocab is padded with UNUSED [PADn] tokens too
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(5)
    vocab = len(tokens)
    head_dim = hidden // heads

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("tiny qwen2 (eaglescale tests)")
    writer.add_block_count(layers)
    writer.add_context_length(context_length)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    def matrix(name: str, rows: int, cols: int, kind: str, std: float | None = None) -> None:
        std = std if std is not None else 1.0 / np.sqrt(cols)
        if kind in ("Q4_K", "Q6_K"):
            writer.add_tensor(name, _k_quant(rng, rows, cols, kind, std), raw_dtype=Q[kind])
            return
        w = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
        if kind == "F16":
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(w, Q[kind]), raw_dtype=Q[kind])

    def vector(name: str, size: int, center: float, std: float) -> None:
        writer.add_tensor(name, (center + rng.standard_normal(size) * std).astype(np.float32))

    matrix("token_embd.weight", vocab, hidden, "Q4_K", std=1.0)
    for i in range(layers):
        last = i == layers - 1  # the other types gguf-py writes, in one layer
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", hidden, 1.0, 0.1)
        matrix(p + "attn_q.weight", heads * head_dim, hidden, "Q4_K")
        vector(p + "attn_q.bias", heads * head_dim, 0.0, 0.2)
        matrix(p + "attn_k.weight", kv_heads * head_dim, hidden, "Q4_K")
        vector(p + "attn_k.bias", kv_heads * head_dim, 0.0, 0.2)
        matrix(p + "attn_v.weight", kv_heads * head_dim, hidden, "Q6_K" if i % 2 else "Q4_K")
        vector(p + "attn_v.bias", kv_heads * head_dim, 0.0, 0.2)
        matrix(p + "attn_output.weight", hidden, heads * head_dim, "F16" if last else "Q4_K")
        vector(p + "ffn_norm.weight", hidden, 1.0, 0.1)
        matrix(p + "ffn_gate.weight", intermediate, hidden, "Q8_0" if last else "Q4_K")
        matrix(p + "ffn_up.weight", intermediate, hidden, "Q5_0" if last else "Q4_K")
        matrix(p + "ffn_down.weight", hidden, intermediate, "Q6_K")
    vector("output_norm.weight", hidden, 1.0, 0.1)
    matrix("output.weight", vocab, hidden, "Q6_K", std=3.0 / np.sqrt(hidden))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def install_parts(gguf: Path, root: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The GGUF as PARTS packages `tiny_part<k>` under root/site (on sys.path), and a spec
    beside them; returns the `multipart://` path of the spec."""
    data = gguf.read_bytes()
    cut = [len(data) * k // PARTS for k in range(PARTS + 1)]
    site = root / "site"
    parts = []
    for k in range(1, PARTS + 1):
        pkg = site / f"tiny_part{k}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{k:02d}.bin").write_bytes(data[cut[k - 1] : cut[k]])
        parts.append({"path": f"package://tiny_part{k}/data/part{k:02d}.bin",
                      "bytes": cut[k] - cut[k - 1], "requirement": f"tiny-part{k}==1.0"})  # fmt: skip
    spec = {"about": "test", "file_name": "tiny-qwen2.gguf", "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(), "parts": parts}  # fmt: skip
    (root / "spec.json").write_text(json.dumps(spec))
    monkeypatch.syspath_prepend(str(site))
    return f"multipart://{root / 'spec.json'}"
