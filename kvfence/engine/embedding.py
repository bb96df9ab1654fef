"""Embeddings of prompts: the final hidden state of a prompt's last token, after the model's final norm,
L2-normalized. That is vLLM's default pooler for the embed task on a decoder-only model (LAST pooling,
normalized); a decoder's last token is the only one that has seen the whole prompt.

Contracts:
- A job never touches the shared KV pool: its K/V go into a scratch tensor of its own (one page as long as
  the prompt, the pool's layout), allocated at its first chunk and freed with the job. No page is
  allocated, no fence check is needed (no page of anybody's is read or written), nothing enters the
  prefix cache, and no request is scheduled, so nothing is left to release when a client goes away.
- The prompt runs as chunked prefill does, at most `chunk_tokens` tokens a `step()` (the engine's
  `max_num_batched_tokens`), each chunk attending over the scratch's earlier positions: the engine thread
  runs one chunk between two engine steps, so a long prompt never stalls generation for more than one
  step's worth of tokens. A prompt is computed the same whatever else is embedded or generated.
- The vector is float32 [hidden_size] with unit L2 norm (a zero vector stays zero).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvfence.model.transformer import PrefillSeq, StepInputs, Transformer


def pool_last(hidden: torch.Tensor) -> torch.Tensor:
    """The embedding of final-norm hidden states [T, hidden] (or of the last one, [1, hidden]): the last
    row, as float32, L2-normalized."""
    return F.normalize(hidden[-1].float(), dim=-1)


class EmbeddingJob:
    """One prompt's embedding, computed a chunk per `step()` (call it until it returns True, then read
    `vector`)."""

    def __init__(self, model: Transformer, prompt: list[int], chunk_tokens: int) -> None:
        if not prompt:
            raise ValueError("an embedding needs at least one token")
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be positive")
        self.model, self.prompt, self.chunk_tokens = model, list(prompt), chunk_tokens
        self.computed = 0
        self.vector: torch.Tensor | None = None
        self._kv: torch.Tensor | None = None

    def step(self) -> bool:
        """Run the next chunk; True once the whole prompt is computed and `vector` is set."""
        if self.vector is not None:
            return True
        model, cfg, total = self.model, self.model.config, len(self.prompt)
        if self._kv is None:
            shape = (cfg.num_layers, 2, 1, total, cfg.num_kv_heads, cfg.head_dim)
            self._kv = torch.zeros(shape, dtype=model.dtype, device=model.device)
        start = self.computed
        end = min(start + self.chunk_tokens, total)
        device, n = model.device, end - start
        positions = torch.arange(start, end, dtype=torch.long, device=device)
        # Nothing computed yet: the chunk's own K/V, plainly causal; else the one scratch page, as a
        # chunked prefill reads its pages.
        table = None if start == 0 else torch.zeros(1, dtype=torch.long, device=device)
        inputs = StepInputs(
            input_ids=torch.tensor(self.prompt[start:end], dtype=torch.long, device=device),
            positions=positions,
            slot_mapping=positions,  # one page of `total` slots: a token's slot is its position
            decode_rows=torch.zeros(0, dtype=torch.long, device=device),
            decode_block_tables=torch.zeros(0, 1, dtype=torch.long, device=device),
            decode_context_lens=torch.zeros(0, dtype=torch.long, device=device),
            prefills=[PrefillSeq(0, n, end, table)],
            logits_rows=torch.tensor([n - 1], dtype=torch.long, device=device),
            zero_page=None,  # no decode rows
        )
        hidden = model.hidden_states(inputs, self._kv)
        self.computed = end
        if end == total:
            self.vector = pool_last(hidden).cpu()
            self._kv = None  # the scratch goes with the last chunk
        return self.vector is not None
