"""The embedding job (engine/embedding.py) on the tiny model of each architecture, on the torch path and on
the C kernels: a prompt computed in chunks over its scratch K/V (sliding windows included) gives the vector
of the prompt computed at once, unit-norm, and the vector depends on the prompt."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_ARCHS, tiny_model

from kvfence.engine.embedding import EmbeddingJob

PROMPT = [(7 * i + 3) % 250 + 1 for i in range(29)]  # longer than Gemma's tiny window (6)


def embed(model: object, prompt: list[int], chunk: int) -> torch.Tensor:
    job = EmbeddingJob(model, prompt, chunk)  # type: ignore[arg-type]
    steps = 1
    while not job.step():
        steps += 1
    assert steps == -(-len(prompt) // chunk) and job.vector is not None
    return job.vector


@pytest.mark.parametrize("matmul", [None, "kernel"], ids=["torch", "kernel"])
@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_chunks_give_the_whole_prompts_vector(arch: str, matmul: str | None) -> None:
    model = tiny_model(config=TINY_ARCHS[arch], decode_matmul=matmul)
    whole = embed(model, PROMPT, 64)
    assert whole.shape == (model.config.hidden_size,) and whole.dtype == torch.float32
    assert float(whole.norm()) == pytest.approx(1.0, abs=1e-6)
    for chunk in (1, 5, 16):
        torch.testing.assert_close(embed(model, PROMPT, chunk), whole, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(embed(model, PROMPT[:-1], 64), whole, atol=1e-3)


def test_an_empty_prompt_is_refused(tiny: object) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        EmbeddingJob(tiny, [], 16)  # type: ignore[arg-type]
