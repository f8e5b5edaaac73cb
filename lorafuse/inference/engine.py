"""Static-shape generation: a preallocated KV cache, batch-size buckets, and a decode step per bucket that is
captured as CUDA graphs on a GPU (the model's forward, then the choice of the next tokens) and runs eagerly on a CPU.

A batch of prompts (token ids) is left-padded to its longest prompt and filled up to its bucket's row count with
copies of its first prompt (their tokens are dropped), then prefilled eagerly in one forward. Each decode step
feeds every row one token and reads and writes only the bucket's static buffers and the cache, so replaying it
needs nothing from the host; sampling runs on the device. The host reads the new tokens every `check_every`
steps, and there alone decides where rows end (EOS, stop strings, the token budget) and streams what they keep.

Why left padding: transformers' StaticCache writes all rows of a forward at the same slot (one write position
per layer), so the prompts must end at the same slot. The padding mask and per-row position ids make each row
compute what it would alone.
"""
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from .._logging import log_once
from ..hf import adapter_swap, decoding, fused_decode, model_kernels
from ..ops.common.dependent_launch import dependent_launches
from ..ops.decode.argmax import argmax_rows
from ..ops.decode.record_tokens import record_tokens
from .graphs import capture
from .sampling import SamplingParams, sample
from .stopping import StopChecker

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)
CAPTURE_RUNS = 4  # runs of each graph at capture: warm-ups (Triton compiles, allocator settles), then the capture
MIN_LENGTH = CAPTURE_RUNS + 1  # those runs write that many cache slots and tokens from slot 0


class _Rows:
    """The static buffers of one bucket, all that its decode step reads and writes besides the cache and the
    weights, and the step's CUDA graphs once captured: the model's forward, then the choice of the next tokens
    (one graph for greedy batches, which skips the sampling filters' sort of the vocabulary, one for sampling)."""

    def __init__(self, cache, size: int, max_length: int, vocab: int, device: torch.device):
        def zeros(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.cache, self.size = cache, size
        self.forward_graph, self.choose_graphs = None, {}
        self.ids = zeros(size, 1)                      # the token each row feeds next
        self.pos = zeros(size, 1)                      # its position in its own sequence (padding not counted)
        self.mask = zeros(size, max_length, dtype=torch.bool)  # the cache slots each row attends to
        self.out = zeros(size, max_length)             # the tokens made so far
        self.slot = zeros(1)                           # the cache slot of the fed token, one for all rows
        self.made = zeros(1)                           # how many tokens each row has made
        self.temperature = zeros(size, dtype=torch.float32)  # sampling settings, set per batch
        self.top_k = zeros(size)
        self.top_p = torch.ones(size, device=device)
        self.logits = zeros(size, vocab, dtype=torch.float32)  # the forward's output, read by the choice


class Engine:
    """Generates from `model` (a transformers causal LM, or a PeftModel with a LoRA adapter) with a static cache
    of `max_length` tokens per row (prompt and new tokens) for up to max(buckets) rows.

    With `fused_step` (by default on CUDA) the decode step is lorafuse.hf.fused_decode's: ten launches per decoder
    layer, the unmerged adapter inside them, the weights of each of a layer's GEMMs laid out in place in one buffer
    (for good: see stack_adapters below). Models it does not cover (the reason logged once: `fused_step_reason`),
    and fused_step=False, run the decode step as transformers' forward; the prefill always does. (On a CPU the
    fused step runs only with TRITON_INTERPRET=1, slowly: it is for tests.)

    With `merge`, a PeftModel's adapter is folded into the weights first (in place, PEFT's merge_and_unload);
    otherwise it stays unmerged and `swap_adapter` replaces it in place. With `stack_adapters` (the default) the
    fused step changes the unmerged adapters in place on the user's model, for good: cast to the model's dtype
    (PEFT keeps them in float32 for training; they are rounded, logged once; vLLM serves LoRA in the model's dtype
    too) and each lora_A stored with the frozen weights of its GEMM. Pass stack_adapters=False to keep the model's
    adapters as they are, at a slower decode step (transformers' forward, whose fused LoRA layers decode them
    through lorafuse.ops.lora.decode as they are). The
    engine's own forwards run RMSNorm on one kernel; the model's other forwards are left alone. On CUDA (or with
    `cuda_graphs=True`) each bucket's decode step is captured at construction (`capture_seconds` says how long
    that took). Models other than Llama, Mistral, Qwen2 and Qwen3 run transformers' generate, the reason logged
    once (`fallback_reason`). `tokenizer` is needed for stop strings only.
    """

    def __init__(self, model: torch.nn.Module, tokenizer=None, *, max_length: int = 1024,
                 buckets: Sequence[int] = DEFAULT_BUCKETS, check_every: int = 8, merge: bool = False,
                 stack_adapters: bool = True, cuda_graphs: bool | None = None, fused_step: bool | None = None):
        if not buckets or any(b < 1 for b in buckets) or check_every < 1 or max_length < MIN_LENGTH:
            raise ValueError(f"Engine: buckets={tuple(buckets)} (positive sizes), check_every={check_every} (>= 1), "
                             f"max_length={max_length} (>= {MIN_LENGTH})")
        self.model = (decoding.merge_adapter(model) if merge else model).eval()
        self.tokenizer = tokenizer
        self.max_length, self.buckets, self.check_every = max_length, tuple(sorted(set(buckets))), check_every
        self.eos_token_ids, self.pad_token_id = decoding.eos_token_ids(self.model), decoding.pad_token_id(self.model)
        self.device = decoding.causal_lm(self.model).device
        self.fallback_reason = decoding.unsupported_reason(self.model)
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"Engine: cuda_graphs=True needs a model on a CUDA device, not {self.device}")
        self._generator = torch.Generator(self.device)
        self.capture_seconds = 0.0
        self.fused_step_reason = self.fallback_reason
        if self.fallback_reason is not None:
            log_once(f"lorafuse.inference: {type(decoding.causal_lm(self.model)).__name__} runs transformers' "
                     f"generate, not captured decoding: {self.fallback_reason}")
            return
        self.fused_step_reason = self._fused_step_reason(fused_step, stack_adapters)
        self._fused = None
        if self.fused_step_reason is None:
            self._fused = fused_decode.FusedDecoder(self.model, max_rows=self.buckets[-1], max_length=max_length)
        self._step_adapters = None  # adapter_names of the rows for transformers' step, eager only (see _adapter_rows)
        self._norms = model_kernels.llama_rms_norms(decoding.causal_lm(self.model))
        self._latest = None  # (rows, how many of them the latest batch used)
        cache = decoding.static_cache(self.model, self.buckets[-1], max_length)
        vocab = decoding.vocab_size(self.model)
        self._rows = {size: _Rows(decoding.cache_rows(cache, size), size, max_length, vocab, self.device)
                      for size in self.buckets}
        if self.cuda_graphs:
            self._capture()

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """The LoRA adapters that rows may name (`adapters` of generate and stream): every adapter of a PeftModel
        that holds several (run side by side in one batch), its active adapter if it holds one, else none."""
        return decoding.adapter_names(self.model)

    @property
    def mixes_adapters(self) -> bool:
        """Whether rows of one batch may run different adapters: with a fused step over an adapter bank, with
        transformers' step stepped eagerly, and with transformers' generate (PEFT routes rows there)."""
        if not self.adapter_names:
            return False
        if self.fallback_reason is not None:
            return True
        return self._fused.bank is not None if self._fused is not None else not self.cuda_graphs

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None,
                 on_tokens: Callable[[int, list[int]], None] | None = None,
                 adapters: Sequence[str | None] | None = None) -> list[list[int]]:
        """The new tokens of each prompt (token ids), EOS or the token completing a stop string included;
        `on_tokens(row, ids)` is called with each row's new tokens as they come (see `stream` for `adapters`). A
        seed fixes the draws of the batch as a whole: the rows draw from one generator, so a prompt's tokens depend
        on the batch it runs in (lorafuse.inference.detokenize turns tokens into the text a user gets)."""
        tokens = [[] for _ in prompts]
        for new in self.stream(prompts, params, adapters):
            for row, ids in new.items():
                tokens[row] += ids
                if on_tokens is not None:
                    on_tokens(row, ids)
        return tokens

    @torch.no_grad()
    def stream(self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None,
               adapters: Sequence[str | None] | None = None) -> Iterator[dict[int, list[int]]]:
        """Yields {row: its new token ids} every `check_every` tokens, for the rows that kept some, until every
        row has ended. Batches larger than the largest bucket run one after another. params: SamplingParams()
        (greedy, 64 new tokens) by default. adapters: per prompt, one of `adapter_names`, "__base__" (no adapter, as
        PEFT names it) or None (the active adapter); rows of one batch may differ where the model holds several
        adapters and the decode step is fused, or runs eagerly."""
        params = SamplingParams() if params is None else params
        prompts = [list(prompt) for prompt in prompts]
        self._check(prompts, params)
        adapters = self._adapter_rows(prompts, adapters)
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        largest = self.buckets[-1]
        for start in range(0, len(prompts), largest):
            chunk = prompts[start:start + largest]
            checker = StopChecker(len(chunk), params.max_new_tokens, self.eos_token_ids, params.stop, decode)
            run = self._generate_eagerly if self.fallback_reason else self._decode
            for new in run(chunk, params, None if adapters is None else adapters[start:start + largest]):
                kept = checker.add(new)
                if kept:
                    yield {start + row: ids for row, ids in kept.items()}
                if checker.all_done:
                    break

    def last_logits(self) -> torch.Tensor:
        """A copy of the logits [n, V] (float32) that the latest token of the latest batch was chosen from, n its
        rows (a batch larger than the largest bucket: its last chunk's). Not for the fallback."""
        if self.fallback_reason is not None or self._latest is None:
            raise RuntimeError("Engine.last_logits: no captured-decoding batch has run yet")
        rows, n = self._latest
        return rows.logits[:n].clone()

    def swap_adapter(self, adapter, name: str | None = None) -> None:
        """Replace the unmerged LoRA adapter `name` (by default the active one) by the one saved in the directory
        `adapter`, in place: the captured steps stay valid (see lorafuse.hf.adapter_swap for what must match)."""
        adapter_swap.swap_adapter(self.model, adapter, name)

    def _adapter_rows(self, prompts: list[list[int]], adapters) -> list[str] | None:
        """Each prompt's adapter as PEFT names it (an adapter name or "__base__"), or None when every row runs the
        active adapter (or the model has none): then nothing is routed per row."""
        if adapters is None:
            return None
        if len(adapters) != len(prompts):
            raise ValueError(f"Engine: {len(adapters)} adapters for {len(prompts)} prompts (one per prompt)")
        names, active = self.adapter_names, decoding.active_adapter(self.model)
        rows = [active if a is None else a for a in adapters]
        unknown = sorted({a for a in rows if a not in names and a != decoding.BASE}, key=str)
        if unknown:
            raise ValueError(f"Engine: adapters {unknown} are not among the model's ({', '.join(names) or 'none'}, "
                             f"or {decoding.BASE!r} for none)")
        if all(a == active for a in rows):
            return None
        if not self.mixes_adapters:
            if self._fused is not None:
                raise ValueError(f"Engine: rows without the model's only adapter ({active!r}) run in the fused step "
                                 "only beside other adapters: load one more into the PeftModel (load_adapter) before "
                                 "building the Engine, or build it with fused_step=False")
            raise ValueError("Engine: rows that do not run the active adapter need the fused decode step (captured "
                             "graphs of transformers' step run the active adapter), which this engine does not run: "
                             f"{self.fused_step_reason}")
        return rows

    def _fused_step_reason(self, fused_step: bool | None, stack_adapters: bool) -> str | None:
        """Why the decode step runs transformers' forward, not the fused step (None: it runs fused); logged once when
        the model is why, not when fused_step asks for it."""
        if not (self.device.type == "cuda" if fused_step is None else fused_step):
            return f"fused_step={fused_step} on {self.device}"
        reason = fused_decode.unsupported_reason(self.model, stack_adapters)
        if reason is not None:
            log_once(f"lorafuse.inference: {type(decoding.causal_lm(self.model)).__name__}'s decode step runs "
                     f"transformers' forward, not the fused step: {reason}")
        return reason

    def _check(self, prompts: list[list[int]], params: SamplingParams) -> None:
        if not prompts or not all(prompts):
            raise ValueError("Engine: prompts must be a non-empty list of non-empty token id lists")
        longest = max(map(len, prompts))
        if longest + params.max_new_tokens > self.max_length:
            raise ValueError(f"Engine: the longest prompt ({longest} tokens) plus max_new_tokens "
                             f"({params.max_new_tokens}) exceed max_length={self.max_length}")

    def _decode(self, prompts: list[list[int]], params: SamplingParams,
                adapters: list[str] | None) -> Iterator[list[list[int]]]:
        """Yields the tokens each row made since the last yield; stops at max_new_tokens or when closed."""
        rows = self._rows[next(size for size in self.buckets if size >= len(prompts))]
        step = self._stepper(rows, greedy=params.temperature == 0)
        self._latest = (rows, len(prompts))
        padded = None if adapters is None else adapters + [adapters[0]] * (rows.size - len(adapters))
        self._select_adapters(rows.size, padded)
        self._prefill(rows, prompts, params, padded)
        made = seen = 1
        yield rows.out[:len(prompts), :1].tolist()
        while made < params.max_new_tokens:
            for _ in range(min(self.check_every, params.max_new_tokens - made)):
                step()
                made += 1
            yield rows.out[:len(prompts), seen:made].tolist()  # the host's one read (and wait) per check
            seen = made

    def _select_adapters(self, size: int, adapters: list[str] | None) -> None:
        """Tells the decode step which adapter each of `size` rows runs (None: every row the active one)."""
        bank = None if self._fused is None else self._fused.bank
        if bank is not None:
            rows = adapters or [decoding.active_adapter(self.model)] * size
            self._fused.select_adapters([len(bank) if a == decoding.BASE else bank.index(a) for a in rows])
        self._step_adapters = adapters  # transformers' step: only without graphs (see _adapter_rows)

    def _prefill(self, rows: _Rows, prompts: list[list[int]], params: SamplingParams,
                 adapters: list[str] | None) -> None:
        """One eager forward over the padded prompts (row i with adapters[i], PEFT's per-row routing); sets every
        buffer for the first decode step."""
        ids, keep = self._left_padded(prompts + [prompts[0]] * (rows.size - len(prompts)))  # [size, T]
        length = ids.shape[1]
        rows.cache.reset()
        with model_kernels.rms_norms_on_kernel(self._norms):
            logits = decoding.next_token_logits(self.model, ids, keep, (keep.cumsum(-1) - 1).clamp(min=0),
                                                rows.cache, adapter_names=adapters)
        rows.logits.copy_(logits)
        rows.mask.zero_()
        rows.mask[:, :length] = keep
        rows.pos.copy_(keep.sum(-1, keepdim=True))
        rows.slot.fill_(length)
        rows.made.fill_(1)
        rows.temperature.fill_(params.temperature)
        rows.top_k.fill_(params.top_k)
        rows.top_p.fill_(params.top_p)
        if params.seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(params.seed)
        first = self._next_tokens(rows.logits, rows, greedy=params.temperature == 0)
        rows.out[:, 0] = first
        rows.ids[:, 0] = first

    def _stepper(self, rows: _Rows, greedy: bool) -> Callable[[], None]:
        """One decode step of `rows`: its graphs replayed, or (not captured) run eagerly."""
        if rows.forward_graph is None:
            return lambda: (self._forward(rows), self._choose(rows, greedy))
        forward, choose = rows.forward_graph.replay, rows.choose_graphs[greedy].replay
        return lambda: (forward(), choose())

    def _forward(self, rows: _Rows) -> None:
        """The model's half of a decode step: feeds each row its token, appends to the cache, leaves the logits in
        rows.logits. Reads and writes only `rows`' buffers and the cache."""
        rows.mask.index_fill_(1, rows.slot, True)  # the slot the fed token is written to becomes visible
        if self._fused is not None:
            self._fused(rows.ids, rows.pos, rows.slot, rows.mask, rows.cache, rows.logits)
            return
        mask = decoding.decode_mask(self.model, rows.mask)
        with model_kernels.rms_norms_on_kernel(self._norms):
            logits = decoding.next_token_logits(self.model, rows.ids, mask, rows.pos, rows.cache,
                                                adapter_names=self._step_adapters,
                                                **decoding.decode_attention_kwargs(self.model, rows.mask))  # [size, V]
        rows.logits.copy_(logits)

    def _choose(self, rows: _Rows, greedy: bool) -> None:
        """The other half: each row's next token from rows.logits, recorded and fed next; the counters advance."""
        token = self._next_tokens(rows.logits, rows, greedy)
        record_tokens(token, rows.out, rows.ids, rows.pos, rows.slot, rows.made)

    def _next_tokens(self, logits: torch.Tensor, rows: _Rows, greedy: bool) -> torch.Tensor:
        # logits: [size, V] -> int64 [size]; greedy batches (temperature 0 on every row) skip the filters' sort
        if greedy:
            return argmax_rows(logits)  # torch.argmax's result; torch reduces a row of the vocabulary in one block
        return sample(logits, rows.temperature, rows.top_k, rows.top_p, self._generator)

    @torch.no_grad()
    def _capture(self) -> None:
        """Every bucket's decode step as CUDA graphs, largest bucket first (its temporaries size the shared pool)."""
        start, pool = time.perf_counter(), torch.cuda.graph_pool_handle()
        decoding.mark_captured(self.model)
        with dependent_launches():  # warm-up launches as the graphs will: each kernel compiled once
            for size in reversed(self.buckets):
                rows = self._rows[size]
                # Warm-up and capture run each graph a few times (CAPTURE_RUNS): from slot 0 each time, so that they
                # stay inside the cache and the buffers (max_length >= MIN_LENGTH).
                rows.cache.reset()
                rows.forward_graph = capture(lambda rows=rows: self._forward(rows), self._generator, pool,
                                             warmup=CAPTURE_RUNS - 1)
                rows.choose_graphs = {}
                for greedy in (True, False):
                    for counter in (rows.pos, rows.slot, rows.made):
                        counter.zero_()
                    rows.choose_graphs[greedy] = capture(lambda rows=rows, greedy=greedy: self._choose(rows, greedy),
                                                         self._generator, pool, warmup=CAPTURE_RUNS - 1)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start

    def _generate_eagerly(self, prompts: list[list[int]], params: SamplingParams,
                          adapters: list[str] | None) -> Iterator[list[list[int]]]:
        """transformers' generate on the whole batch (row i with adapters[i]), seeded from params.seed without touching
        the global RNG."""
        ids, keep = self._left_padded(prompts)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            if params.seed is not None:
                torch.manual_seed(params.seed)
            new = decoding.hf_generate(self.model, ids, keep.long(), max_new_tokens=params.max_new_tokens,
                                       temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                       adapter_names=adapters)
        yield new.tolist()

    def _left_padded(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [B, T] padded on the left, and the keep-mask [B, T] of the real tokens."""
        length = max(map(len, prompts))
        ids = torch.full((len(prompts), length), self.pad_token_id, dtype=torch.long)
        keep = torch.zeros(len(prompts), length, dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            ids[row, length - len(prompt):] = torch.tensor(prompt)
            keep[row, length - len(prompt):] = True
        return ids.to(self.device), keep.to(self.device)
