"""Local EAGLE-3 speculative decoding: a transformers target plus an Eagle3Draft, one process.

Greedy chain speculation (topk=1), batch size 1. One cycle, with c the position of the last
confirmed token x_c (not yet fed to the target):

    draft   extend over the pairs (x_{p+1}, target state at p) that the last verify confirmed,
            then roll out d_1..d_k (step j feeds d_{j-1} with the hidden state that produced it)
    verify  the target reads [x_c, d_1..d_k] at positions c..c+k in one forward: y_0..y_k
    accept  n = leading run of d_i == y_{i-1}; emit y_0..y_n (accepted drafts + the bonus token)
    rewind  both caches drop what follows c+n (static caches: bookkeeping, see
            spec_engine_graphs), c <- c + n + 1

Every emitted token is a target argmax, so at temperature 0 the output equals greedy decoding
token for token, up to the rounding of a (k+1)-token forward against a 1-token one (it can
only flip a near-tie of the top two logits). Finishing follows the local engine (SGLang's
order): the length limit is checked before the stop token, the stop token is part of the output.

Timing: `prefill_s` covers the prompt forward and the draft's extend over the prompt;
`decode_s` the decode loop, which reads y and n back once per cycle (one sync, as a
serving engine does). tok/s = (completion tokens - 1) / decode_s: the first token comes from
prefill. Accept length = tokens per verify = (completion tokens - 1) / verify steps, the
convention of tasks.gate.benchmark.accept_length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from tasks.draft.model import Eagle3Draft
from tasks.gate.spec_engine_graphs import GraphedStep, StaticDraft, StaticTarget


@dataclass
class DecodeResult:
    output_ids: list[int]
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    num_steps: int = 0  # 0: plain greedy decoding
    accepted: list[int] = field(default_factory=list)  # drafts the target agreed with, per verify
    emitted: list[int] = field(default_factory=list)  # tokens output, per verify (<= accepted + 1)

    @property
    def verify_steps(self) -> int:
        return len(self.emitted)

    @property
    def decode_tokens(self) -> int:
        return len(self.output_ids) - 1

    @property
    def accept_length(self) -> float | None:
        return self.decode_tokens / self.verify_steps if self.verify_steps else None


@dataclass
class _CycleBuffers:
    """Static tensors of one num_steps: the verify input, the verify output, the host read."""

    ids: torch.Tensor  # [k+1] verify input: x_c, d_1..d_k
    pos: torch.Tensor  # [k+1] positions c..c+k
    y: torch.Tensor  # [k+1] target argmax after each input
    aux: torch.Tensor  # [k+1, 3H] target aux states at c..c+k
    n: torch.Tensor  # [1] accepted draft tokens
    out: torch.Tensor  # [k+2] y then n: what the host reads each cycle
    draft: GraphedStep | None = None
    verify: GraphedStep | None = None


class SpecEngine:
    """Baseline greedy and speculative greedy decoding on one device, with or without graphs."""

    def __init__(
        self,
        model: PreTrainedModel,
        draft: Eagle3Draft | None,
        *,
        eos_ids: frozenset[int] | set[int] = frozenset(),
        max_len: int = 2048,
        use_cuda_graphs: bool | None = None,
        aux_layer_ids: list[int] | None = None,
    ) -> None:
        self.model = model.eval()
        device = next(model.parameters()).device
        if use_cuda_graphs is None:
            use_cuda_graphs = device.type == "cuda"
        if use_cuda_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA target, this one is on {device}")
        self.use_cuda_graphs = use_cuda_graphs
        self.device = device
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        if draft is not None:
            draft = draft.eval()
            ids = aux_layer_ids if aux_layer_ids is not None else draft.config.aux_layer_ids
            if draft.config.vocab_size != model.get_output_embeddings().weight.shape[0]:
                raise ValueError(
                    f"draft vocab_size {draft.config.vocab_size} differs from the target's "
                    f"{model.get_output_embeddings().weight.shape[0]}"
                )
        else:
            ids = []
        self.draft = draft
        self.target = StaticTarget(model, list(ids), max_len)
        self.static_draft = StaticDraft(draft, max_len) if draft is not None else None
        self.max_len = max_len
        self._cycles: dict[int, _CycleBuffers] = {}
        self.base_ids = torch.zeros(1, dtype=torch.long, device=device)
        self.base_pos = torch.zeros(1, dtype=torch.long, device=device)
        self._base_step: GraphedStep | None = None
        self.offsets = torch.arange(self.target.max_len, device=device)

    @classmethod
    def from_pretrained(
        cls,
        model_path: str,
        draft_dir: str | None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        **kwargs: Any,
    ) -> SpecEngine:
        """Target from any `target.model_path` (a folder, a GGUF, a package path); draft from an
        export (SGLang or speculators format), given the target's embedding."""
        from tasks.draft.export import load_exported
        from tasks.target.model_dir import resolve_model_dir

        model_dir = resolve_model_dir(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
        model = model.to(device)
        draft = None
        if draft_dir is not None:
            embed = model.get_input_embeddings().weight.detach()
            draft = load_exported(draft_dir, embed_weight=embed.float().cpu()).to(device, dtype)
        eos = model.generation_config.eos_token_id
        eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        return cls(model, draft, eos_ids=kwargs.pop("eos_ids", eos_ids), **kwargs)

    # -- shared pieces --------------------------------------------------------------------------

    def _check_room(self, prompt_len: int, max_new_tokens: int, num_steps: int) -> None:
        if prompt_len < 1:
            raise ValueError("prompt_ids is empty")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        need = prompt_len + max_new_tokens + num_steps + 1
        if need > self.max_len:
            raise ValueError(
                f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} + "
                f"{num_steps + 1} speculative slots = {need} exceeds the engine's max_len {self.max_len}"
            )

    def _emit(self, out: list[int], token: int, max_new_tokens: int) -> str | None:
        """Record `token`; the finish reason when the request is done."""
        out.append(token)
        if len(out) >= max_new_tokens:
            return "length"
        if token in self.eos_ids:
            return "stop"
        return None

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _prefill(self, prompt: torch.Tensor, want_aux: bool) -> tuple[int, torch.Tensor | None]:
        positions = torch.arange(prompt.numel(), device=self.device)
        logits, aux = self.target.forward(prompt, positions, last_only=True)
        return int(logits[-1].argmax()), (aux if want_aux else None)

    # -- baseline -------------------------------------------------------------------------------

    def _baseline_fn(self) -> None:
        logits, _ = self.target.forward(self.base_ids, self.base_pos)
        self.base_ids.copy_(logits.argmax(-1))
        self.base_pos.add_(1)

    def baseline_step(self) -> GraphedStep:
        if self._base_step is None:
            self._base_step = GraphedStep(
                self._baseline_fn, self.use_cuda_graphs, reset=lambda: self.base_pos.zero_()
            )
        return self._base_step

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> DecodeResult:
        """Plain greedy decoding, one token per target forward (the baseline)."""
        self._check_room(len(prompt_ids), max_new_tokens, 0)
        step = self.baseline_step()
        began = time.perf_counter()
        prompt = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
        first, _ = self._prefill(prompt, want_aux=False)
        out: list[int] = []
        finish = self._emit(out, first, max_new_tokens)
        self.base_ids.fill_(first)
        self.base_pos.fill_(len(prompt_ids))
        self.sync()
        decode_began = time.perf_counter()
        while finish is None:
            step()
            finish = self._emit(out, int(self.base_ids.item()), max_new_tokens)
        done = time.perf_counter()
        return DecodeResult(out, finish, len(prompt_ids), decode_began - began, done - decode_began)

    # -- speculative ----------------------------------------------------------------------------

    def _draft_cycle(
        self, y: torch.Tensor, aux: torch.Tensor, pos: torch.Tensor, n: torch.Tensor, bufs: _CycleBuffers
    ) -> None:
        """Extend over the confirmed pairs (y[i], aux[i]) at pos[i] for i <= n, roll out
        k drafts, and write the next verify input: [bonus y[n], drafts] at pos[n] + 1 + i."""
        k = bufs.ids.numel() - 1
        drafts = self.static_draft.chain(y, aux, pos, n, k)
        nxt = pos.index_select(0, n) + 1
        bufs.ids.copy_(torch.cat([y.index_select(0, n), drafts]))
        bufs.pos.copy_(nxt + self.offsets[: k + 1])

    def _verify_fn(self, bufs: _CycleBuffers) -> None:
        logits, aux = self.target.forward(bufs.ids, bufs.pos)
        y = logits.argmax(-1)
        bufs.y.copy_(y)
        bufs.aux.copy_(aux)
        accepted = (bufs.ids[1:] == y[:-1]).to(torch.long).cumprod(0).sum()
        bufs.n.copy_(accepted.view(1))
        bufs.out.copy_(torch.cat([y, bufs.n]))

    def cycle_buffers(self, k: int) -> _CycleBuffers:
        if self.static_draft is None:
            raise ValueError("this engine has no draft: speculative decoding needs one")
        if k < 1:
            raise ValueError(f"num_steps must be >= 1, got {k}")
        if k in self._cycles:
            return self._cycles[k]
        dev, width = self.device, self.target.aux_width
        bufs = _CycleBuffers(
            ids=torch.zeros(k + 1, dtype=torch.long, device=dev),
            pos=torch.arange(k + 1, device=dev),
            y=torch.zeros(k + 1, dtype=torch.long, device=dev),
            aux=torch.zeros(k + 1, width, dtype=self.target.dtype, device=dev),
            n=torch.zeros(1, dtype=torch.long, device=dev),
            out=torch.zeros(k + 2, dtype=torch.long, device=dev),
        )

        def reset() -> None:
            bufs.pos.copy_(self.offsets[: k + 1])
            bufs.n.zero_()

        bufs.draft = GraphedStep(
            lambda: self._draft_cycle(bufs.y, bufs.aux, bufs.pos, bufs.n, bufs),
            self.use_cuda_graphs, reset,
        )  # fmt: skip
        bufs.verify = GraphedStep(lambda: self._verify_fn(bufs), self.use_cuda_graphs, reset)
        self._cycles[k] = bufs
        return bufs

    @torch.inference_mode()
    def speculate(self, prompt_ids: list[int], max_new_tokens: int, num_steps: int) -> DecodeResult:
        """EAGLE-3 chain speculative greedy decoding with `num_steps` draft tokens per verify."""
        self._check_room(len(prompt_ids), max_new_tokens, num_steps)
        bufs = self.cycle_buffers(num_steps)
        began = time.perf_counter()
        prompt = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
        first, prompt_aux = self._prefill(prompt, want_aux=True)
        out: list[int] = []
        finish = self._emit(out, first, max_new_tokens)
        accepted: list[int] = []
        emitted: list[int] = []
        if finish is None:
            # The draft's first extend covers the prompt: pairs (x_{p+1}, state p), p < P.
            ext_ids = torch.cat([prompt[1:], torch.tensor([first], device=self.device)])
            last = torch.tensor([len(prompt_ids) - 1], device=self.device)
            positions = torch.arange(len(prompt_ids), device=self.device)
            self._draft_cycle(ext_ids, prompt_aux, positions, last, bufs)
        self.sync()
        decode_began = time.perf_counter()
        while finish is None:
            bufs.verify()
            read = bufs.out.tolist()
            n = read[-1]
            accepted.append(n)
            before = len(out)
            for token in read[: n + 1]:
                finish = self._emit(out, token, max_new_tokens)
                if finish is not None:
                    break
            emitted.append(len(out) - before)
            if finish is None:
                bufs.draft()
        done = time.perf_counter()
        return DecodeResult(
            out, finish, len(prompt_ids), decode_began - began, done - decode_began, num_steps,
            accepted, emitted,
        )  # fmt: skip
