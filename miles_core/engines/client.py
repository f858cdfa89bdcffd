"""``EngineClient``: one async client (httpx) for every engine that speaks SGLang's native HTTP API, the local
engine and SGLang servers alike."""

from __future__ import annotations

import asyncio
import base64
import functools
import ssl
from collections.abc import Mapping
from typing import Any

import httpx

from miles_core.engines.generate_types import GenerateOutput, SamplingParams
from miles_core.engines.routed_experts import RoutingShape
from miles_core.engines.weights import encode_tensors
from miles_core.errors import EngineError  # defined with the other errors; imported from here by older callers
from miles_core.weight_transfer.staging_layout import StagingLayout


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The certificate-checking TLS context of every :class:`EngineClient`, made once per process: httpx builds one
    per client otherwise (loading the CA bundle, 20-40 ms here), which a weight update that opens a client per
    engine pays every step."""
    return httpx.create_ssl_context()


class EngineClient:
    """Talks to one engine at ``url`` (or a router in front of engines: ``is_router``); control routes carry
    ``admin_key``."""

    def __init__(
        self,
        url: str,
        *,
        admin_key: str | None = None,
        name: str = "engine",
        timeout_s: float = 600,
        is_router: bool = False,
    ) -> None:
        self.url = url.rstrip("/")
        self.name = name
        self.is_router = is_router
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout_s, verify=tls_context())

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    # -- data plane -----------------------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int] | list[list[int]],
        sampling_params: Mapping[str, Any] | list | None = None,
        *,
        return_logprob: bool = True,
        rid: str | list[str] | None = None,
        return_routed_experts: bool = False,
        lora_path: str | None = None,
    ) -> Any:
        """``/generate`` with token ids: one response dict, or a list for a batch of prompts; ``lora_path`` names a
        loaded LoRA adapter to generate with (SGLang's field; None: the base)."""
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": sampling_params or {},
            "return_logprob": return_logprob,
        }
        if return_routed_experts:  # only when asked: an engine without the feature refuses the key
            body["return_routed_experts"] = True
        if rid is not None:
            body["rid"] = rid
        if lora_path is not None:  # only when asked: an engine without adapters refuses the key
            body["lora_path"] = lora_path
        return await self._request("POST", "/generate", body)

    async def generate_outputs(
        self,
        input_ids: list[int] | list[list[int]],
        params: SamplingParams | list[SamplingParams],
        *,
        return_logprob: bool = True,
        routing: RoutingShape | None = None,
        lora_path: str | None = None,
    ) -> GenerateOutput | list[GenerateOutput]:
        """``/generate`` with token ids, the answer checked and typed: one :class:`GenerateOutput` for one prompt
        (a list of ids), a list of them for a batch (a list of lists; ``params`` one for all, or one per prompt).
        ``routing`` (the model's :class:`RoutingShape`) asks for every token's routed experts (routing replay);
        ``lora_path`` names the loaded LoRA adapter to generate with.
        A malformed answer is an :class:`EngineError` naming this engine. (:meth:`generate` keeps SGLang's raw
        JSON, for callers that read more of it.)"""
        batch = bool(input_ids) and isinstance(input_ids[0], list)
        count = len(input_ids) if batch else 1
        if not input_ids or (isinstance(params, list) and (not batch or len(params) != count)):
            raise ValueError(
                f"generate_outputs: {count if input_ids else 0} prompt(s) and "
                f"{len(params) if isinstance(params, list) else 1} SamplingParams: give a non-empty list of ids "
                "with one SamplingParams, or a list of prompts with one SamplingParams or one per prompt"
            )
        sampling = [p.to_sglang() for p in params] if isinstance(params, list) else params.to_sglang()
        if isinstance(sampling, list) and all(one == sampling[0] for one in sampling):
            sampling = sampling[0]  # one object for the batch: fewer bytes, and what a router accepts
        if isinstance(sampling, list) and self.is_router:
            return await self._generate_per_setting(
                input_ids, params, return_logprob=return_logprob, routing=routing, lora_path=lora_path
            )
        answer = await self.generate(
            input_ids,
            sampling,
            return_logprob=return_logprob,
            return_routed_experts=routing is not None,
            lora_path=lora_path,
        )
        engine = f"{self.name} ({self.url})"
        prompts = input_ids if batch else [input_ids]

        def read(body: Any, prompt: list[int]) -> GenerateOutput:
            return GenerateOutput.from_sglang(
                body, engine=engine, with_logprobs=return_logprob, routing=routing, prompt_tokens=len(prompt)
            )

        if not batch:
            return read(answer, input_ids)
        if not isinstance(answer, list) or len(answer) != count:
            raise EngineError(
                f"engine {engine} sent a malformed /generate answer: expected a list of {count} answers for "
                f"{count} prompts, got {type(answer).__name__}"
                + (f" of {len(answer)}" if isinstance(answer, list) else "")
            )
        return [read(a, prompt) for a, prompt in zip(answer, prompts, strict=True)]

    async def _generate_per_setting(
        self,
        input_ids: list[list[int]],
        params: list[SamplingParams],
        *,
        return_logprob: bool,
        routing: RoutingShape | None,
        lora_path: str | None,
    ) -> list[GenerateOutput]:
        """A batch for a router, whose ``/generate`` takes one ``sampling_params`` object for all of a batch's
        prompts (a list is a 422): one request per distinct setting, at once, the answers in the prompts' order."""
        by_setting: dict[SamplingParams, list[int]] = {}  # frozen dataclasses: equal settings, one key
        for index, one in enumerate(params):
            by_setting.setdefault(one, []).append(index)
        groups = list(by_setting.values())
        answers = await asyncio.gather(
            *(
                self.generate_outputs(
                    [input_ids[i] for i in group],
                    params[group[0]],
                    return_logprob=return_logprob,
                    routing=routing,
                    lora_path=lora_path,
                )
                for group in groups
            )
        )
        by_index: dict[int, GenerateOutput] = {}
        for group, answer in zip(groups, answers, strict=True):
            by_index.update(zip(group, answer, strict=True))
        return [by_index[index] for index in range(len(input_ids))]

    async def health(self) -> bool:
        try:
            return (await self._http.get("/health", timeout=5)).status_code == 200
        except httpx.HTTPError:
            return False

    async def health_generate(self) -> bool:
        try:
            return (await self._http.get("/health_generate", timeout=25)).status_code == 200
        except httpx.HTTPError:
            return False

    async def model_info(self) -> dict:
        return await self._request("GET", "/model_info")

    async def server_info(self) -> dict:
        return await self._request("GET", "/server_info")

    async def weight_version(self) -> str:
        return str((await self.model_info())["weight_version"])

    # -- control plane --------------------------------------------------------------------------------------

    async def flush_cache(self) -> None:
        response = await self._http.post("/flush_cache")
        if response.status_code != 200:
            raise EngineError(f"engine {self.name} ({self.url}) did not flush its cache: {response.text[:300]}")

    async def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None) -> dict:
        return await self._control("/update_weights_from_disk", model_path=model_path, weight_version=weight_version)

    async def update_weights_from_tensor(
        self, tensors: Mapping[str, Any], *, weight_version: str | None = None
    ) -> dict:
        """Send named tensors as safetensors bytes (never pickle)."""
        payload = base64.b64encode(encode_tensors(tensors)).decode()
        return await self._control(
            "/update_weights_from_tensor",
            serialized_named_tensors=[payload],
            load_format="safetensors",
            weight_version=weight_version,
        )

    async def update_weights_from_loader(
        self,
        payloads: list[str],
        *,
        load_format: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> dict:
        """SGLang's ``/update_weights_from_tensor`` with a custom ``load_format`` (a loader the server was started
        with) and one payload per TP rank (see :mod:`miles_core.weight_transfer.staged_load`); ``weight_version``:
        the version served once it succeeds; ``flush_cache``: drop the prefix cache (the old weights' KV)."""
        return await self._control(
            "/update_weights_from_tensor",
            serialized_named_tensors=payloads,
            load_format=load_format,
            weight_version=weight_version,
            flush_cache=flush_cache,
        )

    async def weights_by_name(self, name: str, *, truncate_size: int = 1) -> Any:
        """SGLang's ``/get_weights_by_name``: the parameter's values (its first ``truncate_size`` rows), or None."""
        return await self._request("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    async def update_weights_from_staging(
        self,
        *,
        staging_path: str,
        buffer_size: int,
        layout: StagingLayout,
        swap: bool = False,
        weight_version: str | None = None,
    ) -> dict:
        """Load the tensors that ``layout`` places in the file ``staging_path`` (``buffer_size`` bytes, in the
        engine's weight-staging directory): copied into the weights, or with ``swap`` served from the file itself
        (the sender must not write it again while the engine may serve from it). Miles' local engine only."""
        return await self._control(
            "/update_weights_from_staging",
            staging_path=staging_path,
            buffer_size=buffer_size,
            layout=layout.to_wire(),
            swap=swap,
            weight_version=weight_version,
        )

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> dict:
        return await self._control(
            "/init_weights_update_group",
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )

    async def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
    ) -> dict:
        return await self._control(
            "/update_weights_from_distributed",
            names=names,
            dtypes=dtypes,
            shapes=shapes,
            group_name=group_name,
            weight_version=weight_version,
        )

    async def begin_weight_update(self) -> dict:
        """Open the engine's weight-update session (SGLang >= 0.5.2x refuses distributed updates outside one)."""
        return await self._control("/begin_weight_update")

    async def end_weight_update(self) -> dict:
        """Close the session :meth:`begin_weight_update` opened."""
        return await self._control("/end_weight_update")

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return await self._control("/destroy_weights_update_group", group_name=group_name)

    async def pause_generation(self, mode: str = "abort") -> dict:
        return await self._request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict:
        return await self._request("POST", "/continue_generation", {})

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> dict:
        return await self._control(
            "/update_weight_version", new_version=new_version, abort_all_requests=abort_all_requests
        )

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        """SGLang's ``/load_lora_adapter``: the peft adapter directory ``lora_path`` served as ``lora_name``; the
        local engine's answer adds the ``digest`` of the adapter as served."""
        return await self._control("/load_lora_adapter", lora_name=lora_name, lora_path=lora_path)

    async def unload_lora_adapter(self, lora_name: str) -> dict:
        """SGLang's ``/unload_lora_adapter``."""
        return await self._control("/unload_lora_adapter", lora_name=lora_name)

    async def weights_checksum(self) -> str:
        """The served weights' checksum (local engine only)."""
        return (await self._request("POST", "/weights_checksum", {}))["checksum"]

    # -- helpers --------------------------------------------------------------------------------------------

    async def _control(self, path: str, **body: Any) -> dict:
        result = await self._request("POST", path, {k: v for k, v in body.items() if v is not None})
        if not result.get("success", False):
            raise EngineError(f"engine {self.name} ({self.url}) {path} failed: {result.get('message')}")
        return result

    async def _request(self, method: str, path: str, body: dict | None = None) -> Any:
        try:
            response = await self._http.request(method, path, json=body if method == "POST" else None)
        except httpx.HTTPError as exc:
            raise EngineError(f"engine {self.name} ({self.url}) {path}: {type(exc).__name__}: {exc}") from exc
        try:
            data = response.json()
        except ValueError:
            data = {"message": response.text[:500]}
        if response.status_code != 200:
            message = data.get("error") or data.get("message") if isinstance(data, dict) else data
            raise EngineError(f"engine {self.name} ({self.url}) {path}: HTTP {response.status_code}: {message}")
        return data
