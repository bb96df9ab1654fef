"""bench/accuracy.py's measures (kvfence/harness/accuracy.py): llama-perplexity's chunks and scored half,
the runner's prompt logits as the logprobs the API reports, and KL / top-1 computed as defined."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from conftest import make_engine

from kvfence.harness.accuracy import Comparison, LlamaBaseLogits, Scorer, chunks, reference_text, sha256
from kvfence.model.transformer import Transformer
from kvfence.sampling import SamplingParams


def test_chunks_are_whole_and_start_with_bos() -> None:
    assert chunks(list(range(10)), 4, 5, bos=99) == [[99, 1, 2, 3], [99, 5, 6, 7]]
    assert chunks(list(range(10)), 4, 1, bos=None) == [[0, 1, 2, 3]]


def test_the_text_is_fixed_prose() -> None:
    text = reference_text()
    assert len(text) > 300_000 and "the" in text.split()[:1000]
    assert sha256(text) == sha256(reference_text())


def test_the_scorer_sees_the_logprobs_the_api_reports(tiny: Transformer) -> None:
    """The scored half's log-probabilities are the prompt logprobs the engine reports for the same tokens."""
    engine = make_engine(tiny)
    chunk = [(7 * i + 3) % 256 for i in range(16)]
    logp, tokens = Scorer(engine)(chunk)
    assert logp.shape == (7, 256) and tokens.tolist() == chunk[9:]
    engine.runner.prompt_logits_observer = None
    (request,) = engine.generate([chunk], SamplingParams(max_tokens=1, prompt_logprobs=0))
    reported = [request.prompt_logprobs[p].logprob for p in range(9, 16)]
    assert torch.allclose(logp.gather(1, tokens.unsqueeze(1)).squeeze(1), torch.tensor(reported), atol=1e-5)


def test_kl_and_top1_as_defined() -> None:
    reference = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0]]), dim=1)
    tokens = torch.tensor([0, 1])
    same = Comparison()
    same.add((reference, tokens), (reference, tokens))
    assert same.summary()["kl_mean"] == 0 and same.summary()["top1_agreement"] == 1.0
    flipped = reference.flip(1)  # row 0's most likely token is now the last
    other = Comparison()
    other.add((flipped, tokens), (reference, tokens))
    p = reference.exp()
    expected = float((p * (reference - flipped)).sum(1).mean())
    summary = other.summary()
    assert math.isclose(summary["kl_mean"], expected, rel_tol=1e-6) and summary["top1_agreement"] == 0.5
    ppl = math.exp(-float(reference[[0, 1], [0, 1]].mean()))
    assert math.isclose(summary["reference_ppl"], ppl, rel_tol=1e-6)


def test_the_base_file_reads_back_as_llama_perplexity_reads_it(tmp_path: Path) -> None:
    """Decoded as the tool's C code decodes it (scale x code + min), each log-probability within half a step
    of the one written, anything more than 16 nats below the top read as the floor, the header exact."""
    torch.manual_seed(0)
    logp = torch.log_softmax(torch.randn(3, 5) * 8, dim=1)
    chunked = [[1, 2, 3, 4, 5, 6, 7, 8]]
    base = LlamaBaseLogits(str(tmp_path / "base.kld"), 8, 5, chunked)
    base.add(logp)
    base.close()
    data = (tmp_path / "base.kld").read_bytes()
    assert data[:8] == b"_logits_" and np.frombuffer(data[8:20], np.int32).tolist() == [8, 5, 1]
    assert np.frombuffer(data[20:52], np.int32).tolist() == chunked[0]
    rows = np.frombuffer(data[52:], np.uint16).reshape(3, 2 * 3 + 4)  # nv for an odd vocabulary of 5
    scale, low = rows[:, :4].copy().view(np.float32).T
    decoded = scale[:, None] * rows[:, 4:9] + low[:, None]
    kept = logp.numpy() >= logp.numpy().max(1, keepdims=True) - 16
    assert np.all(np.abs(decoded - logp.numpy())[kept] <= scale.repeat(5).reshape(3, 5)[kept] / 2 + 1e-6)
    assert np.all(decoded[~kept] == np.broadcast_to(low[:, None], (3, 5))[~kept]) and rows[:, 9].sum() == 0
