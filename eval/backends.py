"""Generation backends for ``longsft eval``: HF transformers, vLLM, OpenAI-compatible HTTP.

Each turns a conversation into the model's reply and reports token counts:
``chat(messages) -> Generation`` (greedy unless told otherwise; chat templates are applied here) and
``generate(prompt)``, the same for one user message.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from longsft.train.common.cpu_features import bf16_hint, fast_bf16
from longsft.train.common.errors import ConfigError
from longsft.train.common.io import say, weights_source
from longsft.train.common.llm import Endpoint, EndpointError


@dataclass
class Generation:
    text: str
    prompt_tokens: int
    gen_tokens: int
    seconds: float
    error: str | None = None
    finish_reason: str = "stop"  # "length" when it stopped at the token limit


def user(prompt: str) -> list[dict]:
    """A conversation of one user message."""
    return [{"role": "user", "content": prompt}]


class HFBackend:
    """``AutoModelForCausalLM.generate`` on CPU or one GPU; rope scaling from the recipe's model config
    (applied to the model's own rope parameters, as training applies it; a trained checkpoint, which
    already carries it, is unchanged)."""

    name = "hf"

    def __init__(self, model_cfg, max_new_tokens: int, enable_thinking: bool = False, dtype: str = "auto"):
        import torch

        from longsft.train.model.build import build_hf_config, build_tokenizer, load_pretrained
        from longsft.train.model.sdpa import use_sdpa_cudnn

        torch_dtype = {"auto": "auto", "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
        try:
            self.tok = build_tokenizer(model_cfg)
        except ConfigError:
            raise
        except (OSError, ValueError) as e:
            raise ConfigError(f"tokenizer={model_cfg.tokenizer}: cannot be loaded ({type(e).__name__}: {e})") from None
        try:
            hf_cfg = build_hf_config(model_cfg)
            # generation needs the KV cache, whatever the checkpoint says (build_hf_config is for training,
            # and older exports wrote use_cache: false)
            hf_cfg.use_cache = True
            source, extra = weights_source(model_cfg.path, model_cfg.gguf_file)
            self.model = load_pretrained(source, extra, config=hf_cfg, dtype=torch_dtype,
                                         trust_remote_code=model_cfg.trust_remote_code)
        except ConfigError:
            raise
        except (OSError, ValueError) as e:  # not a checkpoint, damaged weights, unknown architecture
            raise ConfigError(f"model={model_cfg.path}: cannot be loaded ({type(e).__name__}: {e})") from None
        if getattr(self.model, "generation_config", None) is not None:
            self.model.generation_config.use_cache = True
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model.to(self.device).eval()
        use_sdpa_cudnn(model_cfg.sdpa_cudnn)  # every prefill batch is a new shape (longsft.train.model.sdpa)
        if hint := bf16_hint(self.model.dtype == torch.bfloat16, self.device.type == "cuda", fast_bf16(), "dtype"):
            say(hint)
        self.max_new_tokens, self.enable_thinking = max_new_tokens, enable_thinking
        self._tok_lock = threading.Lock()  # tokenizers are not thread-safe (longsft serve's workers share one)

    @property
    def context(self) -> int | None:
        """The model's context length in tokens (``max_position_embeddings``), if it states one."""
        return getattr(self.model.config, "max_position_embeddings", None)

    def count(self, text: str) -> int:
        with self._tok_lock:
            return len(self.tok.encode(text, add_special_tokens=False))

    def encode_chat(self, messages: list[dict], enable_thinking: bool | None = None) -> list[int]:
        """The conversation through the chat template, ready for the assistant's turn (``enable_thinking``:
        default the backend's)."""
        thinking = self.enable_thinking if enable_thinking is None else enable_thinking
        with self._tok_lock:
            return list(self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False, enable_thinking=thinking))

    def encode_text(self, prompt: str) -> list[int]:
        """A plain prompt's token ids (no chat template), as the tokenizer encodes text."""
        with self._tok_lock:
            return list(self.tok.encode(prompt))

    def decode(self, ids: list[int]) -> str:
        with self._tok_lock:
            return self.tok.decode(ids, skip_special_tokens=True)

    def generate_ids(self, ids: list[int], max_new_tokens: int | None = None, temperature: float = 0.0,
                     top_p: float = 1.0, seed: int | None = None, on_token=None, should_stop=None) -> Generation:
        """The reply to prompt token ids: greedy at temperature 0, else sampled (``seed``: repeatable).
        ``on_token(id)``: called with each new token as it is made (streaming); ``should_stop()``: checked
        after each token, true ends the generation there (a client that went away)."""
        import torch

        t0, limit = time.time(), max_new_tokens or self.max_new_tokens
        sampling = ({"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0} if temperature > 0
                    else {"do_sample": False})
        hooks = {}
        if on_token is not None:
            hooks["streamer"] = _TokenStream(on_token)
        if should_stop is not None:
            from transformers import StoppingCriteria, StoppingCriteriaList

            class _Stop(StoppingCriteria):
                def __call__(self, input_ids, scores, **kwargs):
                    return torch.full((input_ids.shape[0],), should_stop(), dtype=torch.bool, device=input_ids.device)

            hooks["stopping_criteria"] = StoppingCriteriaList([_Stop()])
        x = torch.tensor([ids], device=self.device)
        with torch.no_grad():
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=limit,
                                      use_cache=True, pad_token_id=self.tok.pad_token_id,
                                      eos_token_id=self.tok.eos_token_id, **sampling, **hooks)
        new = out[0, x.shape[1]:].tolist()
        with self._tok_lock:
            text = self.tok.decode(new, skip_special_tokens=True)
        eos = self.tok.eos_token_id if isinstance(self.tok.eos_token_id, list) else [self.tok.eos_token_id]
        finish = "length" if len(new) >= limit and (not new or new[-1] not in eos) else "stop"
        return Generation(text, len(ids), len(new), time.time() - t0, finish_reason=finish)

    def chat(self, messages: list[dict]) -> Generation:
        return self.generate_ids(self.encode_chat(messages))

    def generate(self, prompt: str) -> Generation:
        return self.chat(user(prompt))

    def generate_many(self, prompts: list[str], budget: int) -> list[Generation]:
        """Greedy replies to ``prompts`` (one user message each), generated together in left-padded batches
        of at most ``budget`` tokens (:func:`~longsft.train.model.generate.generate_many`); each
        reply's seconds are its batch's share."""
        from longsft.train.model.generate import generate_many

        ids = [self.encode_chat(user(p)) for p in prompts]
        t0 = time.time()
        outs = generate_many(self.model, ids, self.max_new_tokens, self.tok.pad_token_id, self.tok.eos_token_id,
                             budget, self.device)
        share = (time.time() - t0) / max(1, len(prompts))
        with self._tok_lock:
            texts = [self.tok.decode(o, skip_special_tokens=True) for o in outs]
        eos = self.tok.eos_token_id if isinstance(self.tok.eos_token_id, list) else [self.tok.eos_token_id]
        return [Generation(text, len(i), len(o), share,
                           finish_reason="length" if len(o) >= self.max_new_tokens and (not o or o[-1] not in eos)
                           else "stop") for text, i, o in zip(texts, ids, outs)]


    def generate_batch(self, prompts: list[list[int]], max_tokens: list[int]) -> list[Generation]:
        """Greedy replies to prompt token ids, generated together in one left-padded batch, each cut at its
        own ``max_tokens`` (greedy: the tokens it would get with that cap alone, up to arithmetic: padding
        can change bf16 results on a GPU); each reply's seconds are the batch's."""
        from longsft.train.model.generate import generate_many

        t0, limit = time.time(), max(max_tokens)
        budget = len(prompts) * (max(len(p) for p in prompts) + limit)  # one batch
        outs = generate_many(self.model, prompts, limit, self.tok.pad_token_id, self.tok.eos_token_id, budget,
                             self.device)
        seconds = time.time() - t0
        eos = self.tok.eos_token_id if isinstance(self.tok.eos_token_id, list) else [self.tok.eos_token_id]
        made = []
        for ids, out, cap in zip(prompts, outs, max_tokens):
            out = out[:cap]
            finish = "length" if len(out) >= cap and (not out or out[-1] not in eos) else "stop"
            made.append(Generation(self.decode(out), len(ids), len(out), seconds, finish_reason=finish))
        return made

class _TokenStream:
    """transformers' streamer interface (``put``/``end``): each new token id to ``on_token`` (the first
    ``put`` is the prompt)."""

    def __init__(self, on_token):
        self.on_token, self.prompt_seen = on_token, False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for t in value.reshape(-1).tolist():
            self.on_token(t)

    def end(self) -> None:
        pass


def vllm_engine_args(model_cfg, max_model_len: int = 0, tensor_parallel: int = 1) -> dict:
    """Keyword arguments of ``vllm.LLM`` for ``model_cfg``.

    The recipe's rope scaling goes in as ``hf_overrides={"rope_parameters": ...}``, merged into the
    model's own rope parameters exactly as training merges it (``build_hf_config``). vLLM sets a dict
    override on the HF config as it is, after its own rope checks; under transformers 5 a
    ``rope_scaling`` override replaces ``rope_parameters`` whole and drops ``rope_theta`` (Qwen3-8B:
    1e6 -> None). ``max_model_len`` 0 lets vLLM derive it from those rope parameters.
    """
    from longsft.train.model.build import build_hf_config

    kw: dict = {"model": model_cfg.path, "tensor_parallel_size": tensor_parallel,
                "tokenizer": model_cfg.tokenizer if model_cfg.tokenizer not in (None, "qwen") else None,
                "trust_remote_code": model_cfg.trust_remote_code, "hf_overrides": {}}
    if model_cfg.rope_scaling:
        hf = build_hf_config(model_cfg)
        kw["hf_overrides"] = {"rope_parameters": dict(hf.rope_parameters),
                              "max_position_embeddings": hf.max_position_embeddings}
    if max_model_len:
        kw["max_model_len"] = max_model_len
    return kw


class VLLMBackend:
    """vLLM on GPUs (``pip install longsft[vllm]``); the recipe's rope scaling goes in as an HF override
    (:func:`vllm_engine_args`).

    Not exercised in CI (no GPU); the import error is the message users see without vLLM."""

    name = "vllm"

    def __init__(self, model_cfg, max_new_tokens: int, enable_thinking: bool = False, max_model_len: int = 0,
                 tensor_parallel: int = 1):
        try:
            from vllm import LLM, SamplingParams
        except ImportError:
            raise ConfigError("backend=vllm needs vLLM on a GPU machine: pip install 'longsft[vllm]'") from None
        self.llm = LLM(**vllm_engine_args(model_cfg, max_model_len, tensor_parallel))
        self.params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        self.chat_kwargs = {"enable_thinking": enable_thinking}

    def chat(self, messages: list[dict]) -> Generation:
        t0 = time.time()
        (out,) = self.llm.chat(messages, self.params, chat_template_kwargs=self.chat_kwargs, use_tqdm=False)
        done = out.outputs[0]
        return Generation(done.text, len(out.prompt_token_ids), len(done.token_ids), time.time() - t0,
                          finish_reason="length" if done.finish_reason == "length" else "stop")

    def generate(self, prompt: str) -> Generation:
        return self.chat(user(prompt))


class OpenAIBackend:
    """Any OpenAI-compatible endpoint through longsft's one LLM client (:class:`~longsft.train.common.llm.Endpoint`:
    the SDK's retries, ``Retry-After`` honoured); optional requests-per-minute limit. An endpoint that
    gives no answer after the retries is a failed :class:`Generation` (recorded, retried on the next run)."""

    name = "openai"

    def __init__(self, model: str, base_url: str, max_new_tokens: int, api_key_env: str = "OPENAI_API_KEY",
                 requests_per_minute: float = 0.0, retries: int = 4):
        self.ep = Endpoint(model, base_url.rstrip("/"), api_key_env, retries=retries)
        self.max_new_tokens = max_new_tokens
        self.min_interval = 60.0 / requests_per_minute if requests_per_minute > 0 else 0.0
        self._last = 0.0

    def chat(self, messages: list[dict]) -> Generation:
        wait = self._last + self.min_interval - time.time()
        if wait > 0:
            time.sleep(wait)
        t0 = self._last = time.time()
        try:
            r = self.ep.chat(messages, self.max_new_tokens)
        except EndpointError as e:
            return Generation("", 0, 0, time.time() - t0, error=f"EndpointError: {e}")
        return Generation(r.text, r.prompt_tokens, r.completion_tokens, time.time() - t0, finish_reason=r.finish_reason)

    def generate(self, prompt: str) -> Generation:
        return self.chat(user(prompt))
