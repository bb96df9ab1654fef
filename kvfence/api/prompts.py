"""What a request's text becomes before the engine sees it, the same for the server and the offline API
(kvfence.offline): a conversation rendered by the model's chat template (`encode_chat`, vLLM's
`continue_final_message` included), a prompt cut to its last tokens (`truncate_prompt`), vLLM's `bad_words`
as token sequences (`bad_words_token_ids`).

Contract: each raises APIError 400 naming the field for what it cannot do (a conversation the template
cannot render, a truncation beyond the window, a final message the rendering does not hold).
"""

from __future__ import annotations

from typing import Any

import jinja2

from kvfence.api.errors import APIError
from kvfence.api.protocol import ChatCompletionRequest
from kvfence.model.tokenizer import Tokenizer

NO_CHAT_TEMPLATE = (
    "this model file has no chat template, so /v1/chat/completions cannot render a conversation: send the "
    "prompt as text to /v1/completions, or start the server with --chat-template FILE (a jinja chat template)"
)


def encode_chat(
    tokenizer: Tokenizer,
    body: ChatCompletionRequest,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
) -> list[int]:
    """Render with the model's chat template, then encode without adding special tokens (the template
    already wrote the ones it wants) unless the request asks for them (vLLM's `add_special_tokens`).
    The one rendering of the server and the offline API (kvfence.offline); a conversation it cannot
    render is an APIError 400."""
    try:
        text = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=body.add_generation_prompt,
            tools=tools,
            template_kwargs=body.chat_template_kwargs,
        )
    except (jinja2.TemplateError, ValueError) as exc:
        raise APIError(400, f"cannot render the conversation: {exc}", param="messages") from exc
    if body.continue_final_message:
        text = _open_final_message(text, body.messages[-1].text())
    return tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))


def truncate_prompt(prompt: list[int], keep: int | None, window: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: the window's worth); None keeps
    it whole. More than the window is an APIError 400, as in vLLM."""
    if keep is None:
        return prompt
    if keep > window:
        message = (
            f"truncate_prompt_tokens ({keep}) is greater than the model's maximum context length "
            f"({window}): choose a smaller value, or -1 for the window"
        )
        raise APIError(400, message, param="truncate_prompt_tokens")
    return prompt[-(window if keep == -1 else keep) :]


def bad_words_token_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's encoding of `bad_words`: each word as written (leading space stripped) and, where that is
    another token sequence of the same length, with one leading space (a word inside a sentence)."""
    found = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), False)
        spaced = tokenizer.encode(" " + word.lstrip(), False)
        found.append(bare)
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            found.append(spaced)
    return found


def _open_final_message(text: str, final: str) -> str:
    """vLLM's (and HF's) `continue_final_message`: the rendered chat cut right after the last message's
    text, so what would close it is not there and the model continues it."""
    for content in (final, final.strip()):
        if content and content in text:
            return text[: text.rindex(content) + len(content)]
    message = "continue_final_message: the final message does not appear in the rendered chat"
    raise APIError(400, message, param="continue_final_message")
