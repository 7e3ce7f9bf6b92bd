"""The model's own context: its stated positions, stretched where its RoPE scaling says so, as transformers reads it.

A config states positions (``max_position_embeddings``, GPT-2's ``n_positions``, ...): past them a
model with learned positions fails (GPT-2's embedding raises IndexError) and a rotary one runs
outside what it was made for. RoPE scaling stretches a rotary model's context: its parameters are
read from the config transformers itself builds from them (``rope_scaling`` and ``type`` of older
checkpoints renamed, ``original_max_position_embeddings`` placed by its ``standardize_rope_params``,
Phi-3's top-level one included), and the stretch is transformers' own reading of ``factor``: "a factor
of x will enable the model to handle sequences of length x * original maximum pre-trained length"
(``RopeParameters``, modeling_rope_utils.py). A rope type without a rule here, parameters per layer
type, or a config the installed transformers cannot build keep the stated positions: the context is
never said longer than it is known to be.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from whichdevice.core.frozen import frozen_record
from whichdevice.core.records import TraceStep

__all__ = ["STRETCHED_BY", "Context", "context_steps", "model_context"]

# The config keys that state a model's positions, the first one set wins (transformers' names).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len")

# rope_type -> how transformers 5.25 (modeling_rope_utils.py) scales it and over which original length.
# Types not listed (default, proportional, axial, any later one) fail closed: the stated positions.
STRETCHED_BY = {
    # _compute_linear_scaling_rope_parameters: inv_freq /= factor, positions compressed factor-fold.
    "linear": "linear, factor {factor:g} over {original} positions",
    # _compute_dynamic_ntk_parameters: the base grows once seq_len passes config.max_position_embeddings.
    "dynamic": "dynamic NTK, factor {factor:g} over {original} positions",
    # _compute_yarn_parameters; _validate_yarn_rope_parameters: factor = post-yarn / pre-yarn length.
    "yarn": "YaRN, factor {factor:g} over {original} original positions",
    # _compute_longrope_parameters: factor, else max_position_embeddings / original_max_position_embeddings.
    "longrope": "LongRoPE, factor {factor:g} over {original} original positions",
    # _compute_llama3_parameters: low frequencies scaled by factor past original_max_position_embeddings.
    "llama3": "Llama 3, factor {factor:g} over {original} original positions",
}
# The types whose factor transformers derives from the two lengths where the config gives none.
_FACTOR_FROM_LENGTHS = ("yarn", "longrope")


@frozen_record
class Context:
    """The longest sequence a model is made for (``tokens``), the positions its config states
    (``positions`` under ``key``) and, where RoPE scaling stretches them, how (``scaling``)."""

    tokens: int
    positions: int
    key: str
    scaling: str | None = None

    def text(self) -> str:
        if self.scaling is None or self.tokens == self.positions:
            return f"{self.tokens} positions ({self.key} in its config)"
        return f"{self.tokens} positions ({self.scaling}; {self.key} {self.positions})"


def _language_part(config: Mapping[str, Any]) -> Mapping[str, Any]:
    # A multimodal config keeps the decoder's positions in text_config.
    text = config.get("text_config")
    if not any(config.get(k) for k in POSITION_KEYS) and isinstance(text, Mapping):
        return text
    return config


def _built(config: Mapping[str, Any]) -> Any:
    """The config transformers builds from ``config`` (its own standardization of the rope
    parameters), or None where it cannot (no transformers, an unknown model_type, a bad value)."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return None
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its validation warns about fields it then uses anyway
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        return CONFIG_MAPPING[model_type].from_dict(dict(config))
    except Exception:  # any failure to build means: not read, and the stated positions stand
        return None
    finally:
        quiet.setLevel(level)


def _stretch(rope: Any, positions: int) -> tuple[int, str] | None:
    """(tokens, how) where one set of rope parameters stretches ``positions``; None otherwise."""
    if not isinstance(rope, Mapping) or "rope_type" not in rope:
        return None  # nothing read, or parameters per layer type (transformers' nested form)
    kind = rope.get("rope_type")
    if kind not in STRETCHED_BY:
        return None
    original = rope.get("original_max_position_embeddings", positions)
    factor = rope.get("factor")
    if factor is None and kind in _FACTOR_FROM_LENGTHS and isinstance(original, int) and original > 0:
        factor = positions / original
    if not (isinstance(original, int) and original > 0 and isinstance(factor, (int, float)) and factor >= 1):
        return None
    return max(positions, int(original * factor)), STRETCHED_BY[kind].format(factor=factor, original=original)


def model_context(config: Mapping[str, Any] | None) -> Context | None:
    """The context of a config (config.json's content or a config's to_dict()); None where it states
    no positions."""
    if config is None:
        return None
    part = _language_part(config)
    key = next((k for k in POSITION_KEYS if isinstance(part.get(k), int) and part[k] > 0), None)
    if key is None:
        return None
    positions = int(part[key])
    built = _built(part) if "rope_parameters" in part or "rope_scaling" in part else None
    stretched = _stretch(getattr(built, "rope_parameters", None), positions) if built is not None else None
    if stretched is None:
        return Context(positions, positions, key)
    return Context(stretched[0], positions, key, stretched[1])


def context_steps(context: Context | None, max_length: int | None) -> list[TraceStep]:
    """The warning for a ``max_length`` beyond the model's context, with both numbers; none otherwise."""
    if context is None or max_length is None or max_length <= context.tokens:
        return []
    return [
        TraceStep(
            "warning",
            f"max_length={max_length} is beyond the model's context of {context.text()}: past position "
            f"{context.tokens} the model runs outside what it was made for (learned position embeddings, as "
            f"GPT-2's, raise IndexError there); use max_length={context.tokens} or less, or a model made for "
            "longer sequences",
        )
    ]
