"""A chat request's prompt text: its messages (and tools) rendered by the model's chat template.

One function for both servers: the engine renders the prompt it will run, the gateway the prompt it routes
and meters (its block hashes and its tokens/min reservation), so the two agree token for token only if they
render alike. Everything the request gives the template comes from ``ChatPrompt`` (the part of a chat
completion, and of a chat ``/tokenize``, that the template reads: ``template_messages`` and
``chat_template_kwargs``: the generation prompt, ``continue_final_message``, the tools), so a new template
input is added there once, for both.

Invariant: ``render_chat_prompt(tokenizer, request)`` is exactly the text the engine server tokenizes
(``add_special_tokens=False``: the template writes its own special tokens). A ``response_format`` or
``structured_outputs`` schema is not part of it (it constrains the output, the model never reads it);
``tools`` are, whatever the ``tool_choice`` (``"none"`` too: a conversation's prompt does not change with it).

No tokenizer class is imported here: any object with transformers' ``apply_chat_template`` works.
"""

from __future__ import annotations

from typing import Any

from kvfleet_common.openai_protocol import ChatPrompt


class ChatTemplateError(ValueError):
    """The request cannot be rendered: a 400 for the client (the engine's answer; the gateway routes the
    request without a prefix and lets the engine say it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def render_chat_prompt(tokenizer: Any, request: ChatPrompt) -> str:
    """The prompt text of ``request`` (see the module's invariant). Raises ``ChatTemplateError``."""
    messages = request.template_messages()
    if request.continue_final_message and messages[-1]["role"] != "assistant":
        raise ChatTemplateError("continue_final_message needs the last message to be the assistant's")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **request.chat_template_kwargs())
    except Exception as e:  # jinja errors (e.g. a template that rejects a role sequence)
        raise ChatTemplateError(f"the chat template rejected the messages: {e}", "messages") from None
