"""The grammar's hold on a batch: token masks applied to the logits before sampling, then each sampled token
fed back to its request's matcher.

Contracts:
- Only rows with a grammar are touched; a disallowed token's logit becomes -inf, so greedy (argmax) and
  sampled rows alike can only pick tokens the grammar allows, EOS only where the grammar is complete.
- A row whose matcher is in error, before sampling or on the sampled token, is reported by its index:
  the caller aborts that request alone (`GRAMMAR_ERROR`), never hands out its output as a normal finish.
"""

from __future__ import annotations

import numpy as np
import torch

from kvfence.grammar.compiler import RequestGrammar

GRAMMAR_ERROR = "grammar_error"  # abort reason: the request's matcher failed mid-generation


def apply_masks(
    logits: torch.Tensor, grammars: list[RequestGrammar | None], drafts: list[list[int]] | None = None
) -> set[int]:
    """Mask rows of `logits` [rows, vocab] in place by their grammars; returns the rows whose matcher is in
    error (their logits are left as they are: the caller aborts them). `drafts[row]`: tokens the row's
    position comes after that its matcher has not consumed (speculative decoding verifies several positions
    of one request); the mask is the grammar's after them, and the matcher is left where it was. A row whose
    drafts the grammar refuses is left unmasked: its position follows a draft no sample can match."""
    rows = [row for row, g in enumerate(grammars) if g is not None]
    failed = {row for row in rows if grammars[row].error}  # type: ignore[union-attr]
    rows = [row for row in rows if row not in failed]
    if not rows:
        return failed
    import llguidance.numpy as llg_numpy  # here, not at the top: as compiler._llguidance, mapped at first use

    vocab = logits.shape[1]
    bitmask = llg_numpy.allocate_token_bitmask(len(rows), vocab)
    masked = []
    # On the engine thread, one row after another: a mask takes microseconds here, while llguidance's
    # thread pool (LLExecutor) had its threads fight torch's OpenMP threads for 2 busy cores (9 ms a step
    # for 8 rows, measured).
    for i, row in enumerate(rows):
        grammar, ahead = grammars[row], drafts[row] if drafts else []
        assert grammar is not None
        if grammar.look_ahead(
            ahead, lambda matcher, i=i: llg_numpy.fill_next_token_bitmask(matcher, bitmask, i)
        ):
            masked.append(i)
    forbidden = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab] == 0
    _fill(logits, [rows[i] for i in masked], forbidden[masked])
    failed.update(row for row in rows if grammars[row].error)  # type: ignore[union-attr]
    return failed


def _fill(logits: torch.Tensor, rows: list[int], forbidden: np.ndarray) -> None:
    """logits[rows[i], forbidden[i]] = -inf. On CPU through numpy, one row at a time, single-threaded: a
    torch masked_fill over [rows, 49152] opened an OpenMP region that took 7 ms a step on a busy 2-core
    machine (measured), longer than computing the masks."""
    if logits.device.type == "cpu":
        view = logits.numpy()  # shares memory; also sidesteps torch's in-place rules for inference tensors
        for i, row in enumerate(rows):
            np.putmask(view[row], forbidden[i], -np.inf)
        return
    with torch.inference_mode():  # the model's logits are an inference tensor: update them in place here
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        mask = torch.from_numpy(forbidden).to(logits.device)
        logits[index] = logits[index].masked_fill(mask, float("-inf"))


def advance(grammar: RequestGrammar | None, tokens: list[int]) -> int | None:
    """Feed a request's tokens (a verified request's accepted drafts and its sampled token; else the one
    sampled) to its matcher, if it has one, up to the one that completes the grammar: how many it took
    (the request's output ends with the last of them), or None when the matcher rejects one (it then stays
    in error)."""
    if grammar is None:
        return len(tokens)
    for count, token in enumerate(tokens, 1):
        if not grammar.advance(token):
            return None
        if grammar.is_done:
            return count
    return len(tokens)
