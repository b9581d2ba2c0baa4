"""An exported decoder as a causal LM that transformers' ``generate()`` drives.

    lm = CausalLM("lm.onnx", config=model.config)      # OpenVINO, the cache held inside
    out = lm.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=True, top_p=0.9)

``generate()`` is transformers' own (``GenerationMixin``): greedy, sampling, beam search,
stop tokens, padded batches, streamers, logits processors. Each forward runs the
exported graph on the runtime; the KV cache stays in OpenVINO's compiled model (stateful;
beam search reorders it through the model's ``beam_idx`` input) or travels in and out as
arrays (``stateful=False``, and ONNX Runtime).
"""

from __future__ import annotations

import copy
import inspect

import numpy as np
import torch
from transformers import GenerationConfig, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .generation import Decoder, positions

# the cache's name in forward and in model outputs: ``cache`` from transformers 5.25, ``past_key_values`` before
_CACHE = (
    "cache"
    if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)


class ServedCache:
    """The cache between two forwards: how many positions it holds, and its arrays where the
    runtime does not hold them (None when stateful: the compiled model's state is the cache,
    reordered by ``beam_idx`` at the next forward)."""

    def __init__(self, length: int, arrays: list[np.ndarray] | None, beam_idx: np.ndarray):
        self.length, self.arrays, self.beam_idx = length, arrays, beam_idx

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: row i continues from row ``beam_idx[i]``."""
        idx = np.asarray(beam_idx.cpu(), dtype=np.int64)
        if self.arrays is None:
            self.beam_idx = self.beam_idx[idx]  # composed with a reorder not yet applied
        else:
            self.arrays = [a[idx] for a in self.arrays]


class CausalLM(PreTrainedModel, GenerationMixin):
    """A decoder exported by ``export_decoder``, served on ``runtime`` and driven by
    transformers' ``generate()``. ``config``: the exported model's (its ``config``, or a
    directory or name ``AutoConfig`` reads). Not thread-safe: one generation at a time
    (make one ``CausalLM`` per thread)."""

    main_input_name = "input_ids"
    _is_stateful = False  # transformers' flag for recurrent models; ours is a KV cache
    # a PreTrainedModel without parameters: generate() reads what every transformers model has;
    # the attention is the exported graph's, whatever the config names
    _supports_sdpa = True

    def __init__(self, path: str, config, *, runtime: str = "openvino", stateful: bool = True, threads=None, **kw):
        if not isinstance(config, PretrainedConfig):
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(config)
        if config.is_encoder_decoder:
            raise ValueError(
                f"{type(config).__name__} is an encoder-decoder config; CausalLM serves decoder-only models"
            )
        config = copy.deepcopy(config)  # the init below settles the config's attention and experts
        if getattr(config, "_experts_implementation_internal", None) is not None:
            # a MoE model's experts are the exported graph's too; the name set by the exported
            # model (grouped_mm) is one this parameterless model cannot take
            config._experts_implementation_internal = "eager"
        super().__init__(config)
        self.generation_config = GenerationConfig.from_model_config(config)
        self.decoder = Decoder(path, runtime=runtime, stateful=stateful, threads=threads, **kw)
        self.eval()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # where generate() keeps its tensors; the runtime has its own

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32  # the logits' dtype

    def __repr__(self) -> str:
        d = self.decoder
        return f"CausalLM({type(self.config).__name__}, runtime={d.runtime!r}, stateful={d.stateful})"

    @classmethod
    def can_generate(cls) -> bool:
        return True

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache is the runtime's (or our arrays): generate() makes none

    def is_remote_code(self) -> bool:
        return False

    def _reorder_cache(self, cache: ServedCache, beam_idx: torch.Tensor) -> ServedCache:
        cache.reorder_cache(beam_idx)
        return cache

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits for ``input_ids`` (the tokens the cache does not hold yet), the cache after them."""
        if output_attentions or output_hidden_states:
            raise ValueError(
                "the exported graph returns logits and the cache only: ask for no attentions or hidden states"
            )
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("the exported graph takes input_ids, not inputs_embeds")
        cache: ServedCache | None = kwargs.get(_CACHE)
        ids = np.ascontiguousarray(input_ids.cpu().numpy(), dtype=np.int64)
        batch, length = ids.shape
        past = 0 if cache is None else cache.length
        mask = np.ones((batch, past + length), np.int64) if attention_mask is None else attention_mask.cpu().numpy()
        mask = np.ascontiguousarray(mask, dtype=np.int64)
        pos = positions(mask)[:, -length:] if position_ids is None else position_ids.cpu().numpy().astype(np.int64)
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": np.ascontiguousarray(pos)}
        d = self.decoder
        if cache is None:  # a new generation: an empty cache
            if d.stateful:
                d.request.reset_state()
            cache = ServedCache(0, None if d.stateful else d.layout.empty(batch), np.arange(batch, dtype=np.int32))
        if d.stateful:
            logits, _ = d.step(feeds, [], beam_idx=cache.beam_idx.astype(np.int32))
            cache = ServedCache(past + length, None, np.arange(batch, dtype=np.int32))
        else:
            logits, arrays = d.step(feeds, cache.arrays)
            cache = ServedCache(past + length, arrays, cache.beam_idx)
        return CausalLMOutputWithPast(logits=torch.from_numpy(logits), **{_CACHE: cache})
