"""lorafuse's flash attention as a transformers attention implementation: attn_implementation="lorafuse".

Two functions are registered under "lorafuse" (`register`, called when `lorafuse.hf` is imported):

- `lorafuse_mask` in transformers' AttentionMaskInterface. `create_causal_mask` and friends call it once per
  forward (per mask kind) instead of building an N x N mask; it returns what the attention function needs, as
  flash_attention_2's mask function does: None when there is no padding, else the 2-D keep-mask of the keys
  [B, L] (L < the key length only with a static cache: only the first L cache slots are filled). Without a
  registered mask function, transformers would silently hand the attention function no mask at all.
  Causality, the sliding window and packed sequences are not in that mask: the attention function takes them
  from the module (`is_causal`, `sliding_window`) and from `position_ids`, as flash_attention_2 does. A mask
  pattern beyond those (or_mask_function / and_mask_function overlays, bidirectional or chunked masks, image
  blocks...) is recognised from its mask_function and returned as the dense boolean [B, 1, Nq, Nk] mask that
  sdpa would get, so nothing is dropped.
- `lorafuse_attention_forward` in AttentionInterface, with sdpa_attention_forward's signature and outputs.
  It turns the mask into `AttentionWindows` (per-query intervals of keys: padding, packed sequences, sliding
  windows, and any dense mask whose rows and columns are intervals) and runs `lorafuse.ops.attention.flash_attention`,
  grouped-query heads in place. What the kernel cannot do (dropout, softcapping, attention sinks,
  output_attentions, dense masks that are not intervals or carry biases, non-contiguous padding) runs through
  transformers' sdpa_attention_forward - or the model's own eager attention where sdpa cannot do it either
  (softcap, sinks, attention weights) - with the reason logged once. A caller that knows the relation may pass
  it whole as the forward keyword `lorafuse_windows` (captured decoding does: see lorafuse.hf.decoding).

Per-forward work on a tensor that every layer receives (the mask, the position ids) - checks that read values
on the host, building windows and narrowing them to a sliding window - is memoised on that tensor, so it runs once
per forward, not once per layer.
During CUDA graph capture, compilation or tracing nothing is read on the host: checks are skipped where the
result stays correct without them (windows are built for every case), and dense masks fall back to sdpa.
"""
import logging
import sys
import weakref
from collections import OrderedDict

import torch
from transformers import masking_utils
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

from ..ops.common.traceable_log import log_once_traceable
from ..ops.attention.windows import (AttentionWindows, allowed_keys, padding_mask_is_contiguous,
                                     windows_from_padding_mask, windows_from_position_ids, with_sliding_window)
from ..ops.attention.flash_attention import flash_attention

NAME = "lorafuse"
# A forward keyword (transformers hands a model's extra keywords to every attention call): AttentionWindows that
# say all the relation, from a caller that knows it holds - lorafuse.inference's captured decode step, whose
# static-cache mask cannot be checked on the host during capture.
WINDOWS_KWARG = "lorafuse_windows"


# ---------------------------------------------------------------------------------------------------------------
# Helpers: host syncs, memo
# ---------------------------------------------------------------------------------------------------------------

def _no_host_sync() -> bool:
    """Whether reading a tensor's values on the host is forbidden now (graph capture, compile, tracing)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return True
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()  # capture initialises CUDA


class _Memo:
    """Values computed from a tensor that every layer of one forward receives, kept while that tensor lives
    unchanged (same object, same version counter)."""

    def __init__(self, size: int = 16):
        self._size = size
        self._entries: OrderedDict = OrderedDict()

    def get(self, tensor: torch.Tensor, key: tuple, compute):
        if _no_host_sync():  # values made during capture belong to the graph: never share them
            return compute()
        try:
            version = tensor._version
        except RuntimeError:  # inference tensors have no version counter
            version = None
        entry_key = (id(tensor), key)
        hit = self._entries.get(entry_key)
        if hit is not None and hit[0]() is tensor and hit[1] == version:
            self._entries.move_to_end(entry_key)
            return hit[2]
        value = compute()
        entries = self._entries
        ref = weakref.ref(tensor, lambda _, k=entry_key: entries.pop(k, None))
        entries[entry_key] = (ref, version, value)
        while len(entries) > self._size:
            entries.popitem(last=False)
        return value


_memo = _Memo()


# ---------------------------------------------------------------------------------------------------------------
# The mask function
# ---------------------------------------------------------------------------------------------------------------

def _inner_code(factory, *args):
    """The code object of the closure a transformers mask factory returns (shared by all its closures)."""
    try:
        return factory(*args).__code__
    except Exception:  # a factory missing or changed in this transformers version: its closures stay unknown
        return None


def _factory(name):
    return getattr(masking_utils, name, None) or (lambda *args: None)


_causal = masking_utils.causal_mask_function
_AND_CODE = _inner_code(_factory("and_masks"), _causal)
_SLIDING_CODE = _inner_code(_factory("sliding_window_overlay"), 1)
_PACKED_CODE = _inner_code(_factory("packed_sequence_mask_function"), None)
_REMAP_CODE = _inner_code(_factory("remap_positions_for_packed_sequence"), _causal, None)


def _closure(fn) -> dict:
    cells = fn.__closure__ or ()
    return {name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, cells)}


def _mask_parts(fn) -> set | None:
    """What a mask_function is made of - "causal", "sliding", "packed" - or None if it holds anything else."""
    if fn is _causal:
        return {"causal"}
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    if code is _SLIDING_CODE:
        return {"sliding"}
    if code is _PACKED_CODE:
        return {"packed"}
    if code is _REMAP_CODE:  # packed sequences (transformers >= 5.18): indices remapped to position ids
        return _mask_parts(_closure(fn).get("mask_function"))
    if code is _AND_CODE:
        parts = set()
        for part in _closure(fn).get("mask_functions", (None,)):
            sub = _mask_parts(part)
            if sub is None:
                return None
            parts |= sub
        return parts
    return None


# Dynamo cannot read the closures of mask functions made in the code it traces: it calls this while tracing instead,
# on a copy of the function
@torch.compiler.assume_constant_result
def _is_standard(mask_function) -> bool:
    """Causal, possibly narrowed to a sliding window or split into packed sequences: the patterns the attention
    function rebuilds from the module's is_causal / sliding_window and the position ids."""
    parts = _mask_parts(mask_function)
    return parts is not None and "causal" in parts


def lorafuse_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                  mask_function=masking_utils.causal_mask_function, attention_mask: torch.Tensor | None = None,
                  **kwargs):
    """AttentionMaskInterface function: None (no padding), the 2-D keep-mask [B, L <= kv_length] of the keys, or
    (for patterns the attention function cannot rebuild) the dense bool [B, 1, q_length, kv_length] mask."""
    # An encoder's padding mask (BERT, RoBERTa): bidirectional, the 2-D keep-mask says all
    bidirectional = mask_function is masking_utils.bidirectional_mask_function and q_length == kv_length
    if _is_standard(mask_function) or (bidirectional and attention_mask is not None):
        if attention_mask is not None:
            # Sliding or chunked layers see only the last kv_length keys (full layers: this keeps everything).
            mask = attention_mask[:, -kv_length:]
            if mask.shape[1] == kv_length and not _no_host_sync() and bool(mask.all()):
                return None
            return mask
        if not isinstance(q_offset, torch.Tensor):
            seen = q_offset + q_length - kv_offset  # keys that hold tokens: fewer than kv_length in a static cache
            if seen == kv_length:
                return None
            if 0 < seen < kv_length:
                return torch.ones(batch_size, seen, dtype=torch.bool, device=kwargs.get("device", "cpu"))
    log_once_traceable("lorafuse attention: a mask pattern beyond causal/padding/sliding/packed (or a static cache "
                       "without attention_mask) is materialised as a dense mask", level=logging.INFO)
    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return masking_utils.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                                   kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                                   **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Windows from what the attention function receives
# ---------------------------------------------------------------------------------------------------------------

def _canonical(lo, hi, length):
    empty = lo >= hi
    return (torch.where(empty, length, lo).to(torch.int32).contiguous(),
            torch.where(empty, 0, hi).to(torch.int32).contiguous())


def _windows_from_dense(allowed: torch.Tensor) -> AttentionWindows | None:
    """Windows of a dense relation allowed [B, Nq, Nk], or None if a row or a column is not one interval.
    Reads the answer on the host."""
    n_q, n_k = allowed.shape[-2:]
    a = allowed.to(torch.uint8)
    key_lo, key_hi = a.argmax(-1), n_k - a.flip(-1).argmax(-1)
    query_lo, query_hi = a.argmax(-2), n_q - a.flip(-2).argmax(-2)
    rows_ok = (a.sum(-1) == key_hi - key_lo) | ~allowed.any(-1)
    cols_ok = (a.sum(-2) == query_hi - query_lo) | ~allowed.any(-2)
    if not bool(rows_ok.all() & cols_ok.all()):
        return None
    key_lo, key_hi = _canonical(torch.where(allowed.any(-1), key_lo, n_k), key_hi, n_k)
    query_lo, query_hi = _canonical(torch.where(allowed.any(-2), query_lo, n_q), query_hi, n_q)
    return AttentionWindows(key_lo, key_hi, query_lo, query_hi)


def _dense_to_windows(mask: torch.Tensor, b: int, n_q: int, n_k: int):
    """(windows, None) for a 4-D mask the kernel can run, else (None, why not)."""
    if mask.shape[1] != 1 or mask.shape[0] not in (1, b) or tuple(mask.shape[2:]) != (n_q, n_k):
        return None, "a per-head 4-D attention mask (or one not shaped [B or 1, 1, Nq, Nk])"
    if mask.dtype == torch.bool:
        allowed = mask[:, 0]
    else:
        masked = mask[:, 0] <= torch.finfo(mask.dtype).min / 2  # eager's finfo.min, or -inf
        if not bool((masked | (mask[:, 0] == 0)).all()):
            return None, "an additive attention mask holding biases (not only 0 and -inf)"
        allowed = ~masked
    windows = _windows_from_dense(allowed.expand(b, n_q, n_k))
    return (windows, None) if windows is not None else (None, "a mask whose rows or columns are not intervals")


def _padding_windows(keep: torch.Tensor, n_q: int):
    """(windows, None) for a keep-mask [B, Nk] with one run of tokens per row, else (None, why not)."""
    if not _no_host_sync() and not padding_mask_is_contiguous(keep):
        return None, "padding that is not one run of tokens per row"
    return windows_from_padding_mask(keep, n_q), None


def _packed_windows(position_ids: torch.Tensor, b: int) -> AttentionWindows:
    """Windows of packed sequences (position ids that restart inside a row); rows of one sequence get plain causal
    windows. Built on the device whether or not the ids restart: asking would stall the host until the GPU has
    drained its queue, once per forward (a large share of a Llama-1B training step). Without
    padding they are UnpaddedWindows, which cost the kernels next to nothing over none."""
    pos = position_ids if position_ids.shape[0] == b else position_ids.expand(b, -1)
    return windows_from_position_ids(pos)


def _cu_seqlens_windows(cu_q: torch.Tensor, cu_k, n: int, device) -> AttentionWindows | None:
    """Windows of one row of n tokens packed as the sequences [cu[i], cu[i+1]) (flash-attention varlen kwargs,
    as DataCollatorWithFlattening(return_flash_attn_kwargs=True) makes them), or None if keys differ from queries."""
    if cu_k is not None and cu_k is not cu_q and (_no_host_sync() or not torch.equal(cu_q, cu_k.to(cu_q.device))):
        return None
    cu = cu_q.to(device=device, dtype=torch.long)
    idx = torch.arange(n, device=device)
    seq = (torch.searchsorted(cu, idx, right=True) - 1).clamp(0, cu.numel() - 1)
    return windows_from_position_ids((idx - cu[seq])[None])


class _Plan:
    """How one attention call runs: the keys it uses (n_k; a static cache may hold unused slots), causal or not,
    the windows - or why the kernel cannot run, and what the fallback needs (the keep-mask or the dense mask)."""

    def __init__(self, n_k, causal, windows=None, reason=None, keep=None, dense_mask=None):
        self.n_k, self.causal, self.windows, self.reason = n_k, causal, windows, reason
        self.keep, self.dense_mask = keep, dense_mask


def _sliding_windows(windows: AttentionWindows | None, window: int, b: int, n_q: int, n_k: int, device):
    """`windows` (None: every key) narrowed to causal sliding windows of `window` keys."""
    if windows is None:
        windows = windows_from_padding_mask(torch.ones(b, n_k, dtype=torch.bool, device=device), n_q)
    return with_sliding_window(windows, window, n_q, n_k)


def _plan(query, key, attention_mask, causal: bool, sliding_window, kwargs) -> _Plan:
    b, n_q, n_k = query.shape[0], query.shape[2], key.shape[2]
    source = None  # (tensor, key) the windows are memoised on: so are their sliding-window narrowings
    if attention_mask is None:
        plan = _Plan(n_k, causal)
        cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        position_ids = kwargs.get("position_ids")
        if n_q == n_k and n_q > 1:
            if isinstance(cu_q, torch.Tensor) and b == 1:
                source = (cu_q, ("cu", n_q))
                plan.windows = _memo.get(*source, lambda: _cu_seqlens_windows(cu_q, cu_k, n_q, query.device))
            if (plan.windows is None and isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2
                    and position_ids.shape[1] == n_q and position_ids.shape[0] in (1, b)):
                source = (position_ids, ("packed", b))
                plan.windows = _memo.get(*source, lambda: _packed_windows(position_ids, b))
    elif not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() not in (2, 4):
        return _Plan(n_k, False, reason=f"an attention mask of type {type(attention_mask).__name__} (not None, "
                     "2-D or 4-D)", dense_mask=attention_mask)
    elif attention_mask.dim() == 2:
        n_k = min(n_k, attention_mask.shape[1])  # a static cache: only the first slots hold tokens
        keep = attention_mask[:, attention_mask.shape[1] - n_k:] if n_k < attention_mask.shape[1] else attention_mask
        plan = _Plan(n_k, causal, keep=keep)
        if n_q > n_k or (not causal and n_q != n_k):
            plan.reason = ("a padding mask with more queries than keys" if causal else
                           "a padding mask on non-causal attention with query and key lengths that differ")
        else:
            source = (attention_mask, ("padding", n_q, n_k))
            plan.windows, plan.reason = _memo.get(*source, lambda: _padding_windows(keep, n_q))
    else:
        # The whole relation is in the mask (causality and sliding window included), as sdpa reads it.
        plan = _Plan(n_k, False, dense_mask=attention_mask)
        if _no_host_sync():
            plan.reason = "a dense attention mask (not converted to windows during capture or compilation)"
        else:
            plan.windows, plan.reason = _memo.get(attention_mask, ("dense", b, n_q, n_k),
                                                  lambda: _dense_to_windows(attention_mask, b, n_q, n_k))
        return plan
    if sliding_window is not None and plan.reason is None and sliding_window < plan.n_k:
        if not causal:
            plan.reason = "a sliding window without causal masking"
        else:
            def narrowed():
                return _sliding_windows(plan.windows, sliding_window, b, n_q, plan.n_k, query.device)
            plan.windows = (narrowed() if plan.windows is None else
                            _memo.get(source[0], source[1] + ("sliding", sliding_window), narrowed))
    return plan


# ---------------------------------------------------------------------------------------------------------------
# The attention function
# ---------------------------------------------------------------------------------------------------------------

def _unsupported_reason(module, query, key, value, dropout, softcap, s_aux, kwargs) -> str | None:
    if dropout:
        return f"attention dropout {dropout}"
    if softcap is not None:
        return "softcapping"
    if s_aux is not None:
        return "attention sinks (s_aux)"
    if kwargs.get("output_attentions"):
        return "output_attentions=True"
    if value.shape[-1] != query.shape[-1] or key.shape[-1] != query.shape[-1]:
        return f"value head dim {value.shape[-1]} differs from query/key head dim {query.shape[-1]}"
    if not (query.dtype == key.dtype == value.dtype):
        return f"query, key, value dtypes {query.dtype}, {key.dtype}, {value.dtype} differ"
    if 0 in query.shape or 0 in key.shape:
        return "an empty query or key"
    return None


def _fallback(reason, plan: _Plan, module, query, key, value, dropout, scaling, softcap, s_aux, sliding_window,
              kwargs):
    """sdpa_attention_forward (or the model's eager attention for softcap / sinks / attention weights) on the
    dense mask of the same relation; queries with no key output zeros, as the kernel's do."""
    n_q, n_k = query.shape[2], plan.n_k
    key, value = key[:, :, :n_k], value[:, :, :n_k]
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    needs_eager = softcap is not None or s_aux is not None or kwargs.get("output_attentions")
    if needs_eager and eager is None and (softcap is not None or s_aux is not None):
        raise NotImplementedError(f"lorafuse attention: {reason} needs the model's eager attention, which "
                                  f"{type(module).__module__} does not define")
    use_eager = needs_eager and eager is not None
    log_once_traceable(f"lorafuse attention: {'eager' if use_eager else 'sdpa'} attention runs because of {reason}")

    has_key = None
    if plan.dense_mask is not None:
        mask = plan.dense_mask
        if use_eager and mask.dtype == torch.bool:
            mask = torch.where(mask, 0.0, torch.finfo(query.dtype).min).to(query.dtype)
    else:
        allowed = allowed_keys(plan.windows, n_q, n_k, plan.causal, query.device)  # [B|1, Nq, Nk]
        if plan.windows is None:
            if plan.keep is not None:
                allowed = allowed & plan.keep[:, None, :].bool()
            if sliding_window is not None and plan.causal:
                i = torch.arange(n_q, device=query.device)[:, None] + (n_k - n_q)
                allowed = allowed & (torch.arange(n_k, device=query.device)[None, :] > i - sliding_window)
        has_key = allowed.any(-1)                     # [B|1, Nq]
        mask = (allowed | ~has_key[..., None])[:, None]  # rows without keys: any keys, zeroed below (no NaN)
        if use_eager:
            mask = torch.where(mask, 0.0, torch.finfo(query.dtype).min).to(query.dtype)
    extra = dict(kwargs, sliding_window=sliding_window)
    if use_eager:
        out, weights = eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, softcap=softcap,
                             s_aux=s_aux, **extra)
    else:
        out, weights = sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                              is_causal=False, **extra)
    if has_key is not None:
        out = torch.where(has_key[:, :, None, None], out, 0)  # out: [B, Nq, H, D]
    return out, weights


def lorafuse_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                               is_causal: bool | None = None, sliding_window: int | None = None,
                               softcap: float | None = None, s_aux: torch.Tensor | None = None, **kwargs):
    """AttentionInterface function: query [B, Hq, Nq, D], key, value [B, Hkv, Nk, D] -> ([B, Nq, Hq, D], None)."""
    if kwargs.get("cache") is not None:  # continuous batching's paged cache: sdpa updates it
        log_once_traceable("lorafuse attention: sdpa attention runs because of a paged cache (continuous batching)")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    windows = kwargs.pop(WINDOWS_KWARG, None)
    if windows is not None:
        if sliding_window is not None:
            raise ValueError(f"lorafuse attention: {WINDOWS_KWARG} on a sliding-window layer (sliding_window="
                             f"{sliding_window}); the windows must say the whole relation: pass none there")
        if tuple(windows.key_lo.shape) != (query.shape[0], query.shape[2]):
            raise ValueError(f"lorafuse attention: {WINDOWS_KWARG} holds key windows for {tuple(windows.key_lo.shape)} "
                             f"queries, the call has [B, Nq] = {[query.shape[0], query.shape[2]]}")
        plan = _Plan(key.shape[2], False, windows=windows)
    else:
        plan = _plan(query, key, attention_mask, causal, sliding_window, kwargs)
    reason = plan.reason or _unsupported_reason(module, query, key, value, dropout, softcap, s_aux, kwargs)
    if reason is not None:
        return _fallback(reason, plan, module, query, key, value, dropout, scaling, softcap, s_aux, sliding_window,
                         kwargs)
    if plan.n_k != key.shape[2]:
        key, value = key[:, :, :plan.n_k], value[:, :, :plan.n_k]
    out = flash_attention(query, key, value, causal=plan.causal, scale=scaling, windows=plan.windows, transposed=True)
    return out.contiguous(), None  # contiguous from the kernels: a copy only after flash_attention's SDPA fallback


def register() -> None:
    """Register attn_implementation="lorafuse" (attention and mask functions) with transformers. Idempotent."""
    AttentionInterface.register(NAME, lorafuse_attention_forward)
    masking_utils.AttentionMaskInterface.register(NAME, lorafuse_mask)
