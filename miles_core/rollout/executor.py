"""``RolloutExecutor``: the data side of a step. ``get(rollout_id)`` picks the step's prompts (the same ones for
the same id, so a resumed run sees the same data), generates ``group_size`` samples per prompt across the engines
(or through a router), scores them, computes group statistics and returns the training batch.

A request that fails because its engine died is sent again to a running engine once the controller has one, so
no sample of the step is lost. Rewards see the response decoded without special tokens (:func:`decode_response`)
and are scored off the event loop by a :class:`~miles_core.rollout.rewards.RewardScorer`: a reward that raises,
returns no finite number or hangs scores 0 and is counted (``reward/errors``, ``reward/timeouts``); one that keeps
failing stops the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import math
import random
import statistics
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from miles_core.engines.client import EngineClient, EngineError
from miles_core.engines.generate_types import GenerateOutput, SamplingParams, parse_weight_version
from miles_core.engines.routed_experts import RoutedExperts, RoutingShape
from miles_core.errors import MilesError
from miles_core.rollout.agents import Agent, is_session_failure
from miles_core.rollout.eval_at_k import at_k_stats, eval_seed
from miles_core.rollout.prompt_encoding import PromptEncoder
from miles_core.rollout.prompt_order import PromptOrder
from miles_core.rollout.prompts import Prompt
from miles_core.rollout.rewards import RewardPlan, RewardScorer, checked_reward, describe
from miles_core.rollout.samples import Group, GroupFilter, Rollout, Sample
from miles_core.rollout.sessions.session import Trajectory
from miles_core.training.algorithms import AdvantageEstimator, ScoredSample
from miles_core.training.batch import TrainBatch, TrainSample

if TYPE_CHECKING:
    from miles_core.config.sections import EngineSection, RolloutSection, RunSection, TrainSection
    from miles_core.rollout.sessions.pool import SessionServers

MAX_ATTEMPTS = 5
STEP_PROMPTS_KEPT = 8


MAX_FILTER_ROUNDS = 8
MAX_CUTS = 64
"""Waves in a row that weight updates cut without any sample finishing before a rollout gives up."""


class RolloutExecutor:
    def __init__(
        self,
        *,
        run: RunSection,
        rollout: RolloutSection,
        train: TrainSection,
        engine: EngineSection,
        tokenizer: Any,
        train_prompts: Sequence[Prompt],
        eval_prompts: Sequence[Prompt],
        reward: RewardPlan,
        controller: Any,
        advantages: AdvantageEstimator,
        filters: list[GroupFilter] | None = None,
        initial_version: int = 0,
        agent: Agent | None = None,
        sessions: SessionServers | None = None,
        routing: RoutingShape | None = None,
        encoder: PromptEncoder | None = None,
    ) -> None:
        """``run``, ``rollout``, ``train``, ``engine``: the config's sections it reads (the seed, the rollout's
        settings, how long to wait for engines). ``advantages``: the run's advantage estimator
        (:func:`~miles_core.training.algorithms.choose_algorithm`). ``agent`` and ``sessions``: an
        agent run's agent and the session servers it plays samples through (both or neither); without them, samples
        are generated single-turn, in batches. ``routing``: the model's routing shape, to ask the engines for every
        token's routed experts and hand them to the trainer (routing replay; not with an agent, whose turns go
        through the session servers). ``reward``: how samples are scored (:func:`~miles_core.run_setup.load_reward`),
        with ``rollout``'s timeout, workers and failure limit. ``encoder``: encodes each prompt and checks its ids
        against the model (:func:`miles_core.run_setup.prompt_encoder`; ``None``: encoded unchecked but for empty
        ids)."""
        if (agent is None) != (sessions is None):
            raise MilesError("an agent needs session servers, and session servers an agent")
        if routing is not None and agent is not None:
            raise MilesError(
                "routing replay (--train-routing-replay) is not available with an agent (--rollout-agent): the "
                "session servers do not carry routed experts yet; turn one of them off"
            )
        self.routing = routing
        self.run, self.rollout, self.train, self.engine = run, rollout, train, engine
        self.tokenizer = tokenizer
        self.reported_notes: set[str] = set()  # the chat format's warnings already shown, by summary
        self.train_prompts = train_prompts
        self.eval_prompts = eval_prompts
        self.scorer = RewardScorer(
            reward,
            timeout_s=rollout.reward_timeout_s,
            workers=rollout.reward_workers,
            max_consecutive_failures=rollout.reward_max_consecutive_failures,
        )
        self.controller = controller
        self.advantages = advantages
        self.filters = list(filters or [])
        self.initial_version = initial_version  # the version of the weights the engines started with
        self.agent, self.sessions = agent, sessions
        self._next_engine = 0
        self._next_session_engine = 0
        self.encoder = encoder or PromptEncoder(tokenizer)
        self._order = PromptOrder(len(train_prompts), seed=run.seed, batch_size=rollout.batch_size)
        self._step_prompts: dict[int, list[Prompt]] = {}  # the last rollouts' prompts (fully_async has several)

    # -- data order -----------------------------------------------------------------------------------------

    def prompts_for(self, rollout_id: int) -> list[Prompt]:
        """The step's prompts (:class:`~miles_core.rollout.prompt_order.PromptOrder`), drawn once per rollout (every
        group of it asks)."""
        chosen = self._step_prompts.get(rollout_id)
        if chosen is None:
            chosen = [self.train_prompts[i] for i in self._order.indices(rollout_id)]
            if len(self._step_prompts) >= STEP_PROMPTS_KEPT:  # the oldest goes: rollouts move forward
                del self._step_prompts[min(self._step_prompts)]
            self._step_prompts[rollout_id] = chosen
        return list(chosen)

    def prompt_of(self, rollout_id: int, slot: int) -> Prompt:
        """The prompt of a step's group ``slot``: :meth:`prompts_for` for the first ``batch_size`` slots, then (extra
        groups that replace filtered ones) a seeded draw that depends on the id and slot alone."""
        size = self.rollout.batch_size
        if slot < size:
            return self.prompts_for(rollout_id)[slot]
        draw = random.Random(f"{self.run.seed}/{rollout_id}/{slot}")
        return self.train_prompts[draw.randrange(len(self.train_prompts))]

    # -- steps ----------------------------------------------------------------------------------------------

    async def get(self, rollout_id: int) -> Rollout:
        """Step ``rollout_id``'s batch: ``batch_size`` groups (plus ``--rollout-over-sampling`` extra ones) generated
        together; groups the filters refuse are replaced by further ones, in rounds, until the batch is full."""
        size, extra = self.rollout.batch_size, self.rollout.over_sampling
        kept: list[Group] = []
        filtered, next_slot = 0, 0
        for _ in range(MAX_FILTER_ROUNDS):
            count = size - len(kept) + (extra if self.filters or next_slot == 0 else 0)
            groups = await self.groups_at([(rollout_id, slot) for slot in range(next_slot, next_slot + count)])
            next_slot += count
            for group in groups:
                if self.keeps(group):
                    kept.append(group)
                else:
                    filtered += 1
            if len(kept) >= size:
                return self.rollout_of(rollout_id, kept[:size], {"rollout/filtered_groups": float(filtered)})
        raise MilesError(
            f"the rollout filters {', '.join(name for name, _ in self.filters)} refused {filtered} of {next_slot} "
            f"groups of rollout {rollout_id} in {MAX_FILTER_ROUNDS} rounds: loosen them, or raise "
            "--rollout-over-sampling"
        )

    async def group(self, rollout_id: int, slot: int) -> Group:
        """One group, generated and scored; its seeds depend on ``(run seed, rollout_id, slot)`` alone."""
        return (await self.groups_at([(rollout_id, slot)]))[0]

    async def groups_at(self, places: list[tuple[int, int]]) -> list[Group]:
        """The groups at ``(rollout_id, slot)`` places, generated together (one request per engine: every request
        costs the driver's HTTP client CPU time) and scored."""
        size, batch_size = self.rollout.group_size, self.rollout.batch_size
        groups = []
        for rollout_id, slot in places:
            prompt = self.prompt_of(rollout_id, slot)
            ids = self.encoder.ids(prompt, where=f"train prompt {slot} of rollout {rollout_id}")
            index, seed_base = rollout_id * batch_size + slot, (self.run.seed * 1_000_003 + rollout_id) * 4096
            samples = [
                Sample(
                    index=slot * size + k,
                    prompt=prompt,
                    prompt_ids=list(ids),
                    group=index,
                    seed=seed_base + slot * size + k,
                )
                for k in range(size)
            ]
            groups.append(Group(index, rollout_id, slot, samples))
        temperature = self.rollout.temperature
        wheres = [f"sample {{index}} of rollout {g.rollout_id} (step {g.rollout_id + 1})" for g in groups]
        if self.agent is not None:  # every sample at once; an agent's branches join their sample's group
            played = await asyncio.gather(
                *(
                    self._play_all([(s, where) for s in g.samples], temperature)
                    for g, where in zip(groups, wheres, strict=True)
                )
            )
            for group, samples in zip(groups, played, strict=True):
                group.samples = samples
            return groups
        samples = [sample for group in groups for sample in group.samples]
        await self._generate(samples, self._sampling(temperature=temperature))
        await self.scorer.score(samples, [where for g, where in zip(groups, wheres, strict=True) for _ in g.samples])
        return groups

    def keeps(self, group: Group) -> bool:
        """Whether every ``--rollout-filters`` filter keeps ``group``; a filter that raises or answers other than a
        bool stops the run, naming it."""
        for name, keep in self.filters:
            try:
                answer = keep(group)
            except Exception as exc:
                raise MilesError(
                    f"rollout filter {name} raised on group {group.index}: {type(exc).__name__}: {exc}"
                ) from exc
            if not isinstance(answer, bool):
                raise MilesError(f"rollout filter {name} returned {answer!r:.60} on group {group.index}, not a bool")
            if not answer:
                return False
        return True

    def rollout_of(self, rollout_id: int, groups: list[Group], stats: dict[str, float] | None = None) -> Rollout:
        """The training batch of ``groups``: GRPO advantages within each group; with ``--rollout-mask-off-policy``,
        each sample's tokens from before its last weight version masked off."""
        samples = [sample for group in groups for sample in group.samples]
        advantages = self._advantages(groups)
        mask = self.rollout.mask_off_policy
        batch = TrainBatch(
            [
                TrainSample(
                    s.prompt_ids,
                    s.response_ids,
                    s.logprobs,
                    a,
                    s.reward,
                    s.train_mask(mask_off_policy=mask),
                    s.routed_experts,
                )
                for s, a in zip(samples, advantages, strict=True)
            ]
        )
        stats = {**self._stats(samples, "rollout"), **(stats or {})}
        stats["rollout/continued_samples"] = float(sum(len(s.segments) > 1 for s in samples))
        return Rollout(rollout_id, samples, batch, stats, [group.index for group in groups])

    def _advantages(self, groups: list[Group]) -> list[float | tuple[float, ...]]:
        """The estimator's advantage of every sample, checked: one per sample, a number or one number per response
        token, all finite (an estimator that breaks this is named)."""
        scored = [[ScoredSample(float(s.reward), len(s.response_ids)) for s in g.samples] for g in groups]
        samples = [sample for group in groups for sample in group.samples]
        found = self.advantages.advantages(scored)
        name = f"advantage estimator {self.advantages.name!r}"
        if not isinstance(found, list) or len(found) != len(samples):
            count = len(found) if isinstance(found, list) else type(found).__name__
            raise MilesError(f"{name} returned {count} advantages for {len(samples)} samples")
        checked: list[float | tuple[float, ...]] = []
        for sample, value in zip(samples, found, strict=True):
            values = value if isinstance(value, tuple) else (value,)
            if isinstance(value, tuple) and len(value) != len(sample.response_ids):
                raise MilesError(
                    f"{name} returned {len(value)} token advantages for sample {sample.index}, which has "
                    f"{len(sample.response_ids)} response tokens"
                )
            if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in values):
                raise MilesError(f"{name} returned {value!r:.80} for sample {sample.index}: not finite numbers")
            checked.append(tuple(float(v) for v in value) if isinstance(value, tuple) else float(value))
        return checked

    async def evaluate(self, rollout_id: int) -> Rollout:
        """Greedy answers to the held-out prompts (the rollout's samples and the ``eval/`` metrics); with
        ``--rollout-eval-samples K`` above 1, also K samples of each at the rollout temperature, for ``eval/pass@K``
        and ``eval/mean@K`` (:mod:`~miles_core.rollout.eval_at_k`)."""
        greedy = [
            Sample(index=i, prompt=p, prompt_ids=self.encoder.ids(p, where=f"eval prompt {i}"), seed=i)
            for i, p in enumerate(self.eval_prompts)
        ]
        greedy = await self._answer(greedy, 0.0, f"eval sample {{index}} at step {rollout_id}")
        stats = self._stats(greedy, "eval")
        k = self.rollout.eval_samples
        if k > 1:
            sampled = await self._answer(
                self._eval_samples(k), self.rollout.temperature, f"eval sample {{index}} (of {k}) at step {rollout_id}"
            )
            per_prompt: list[list[float]] = [[] for _ in self.eval_prompts]
            for sample in sampled:  # an agent's branches keep their sample's index
                per_prompt[sample.index // k].append(sample.reward)
            stats |= at_k_stats(per_prompt, k=k, threshold=self.rollout.eval_pass_threshold)
        return Rollout(rollout_id, greedy, None, stats)

    def _eval_samples(self, k: int) -> list[Sample]:
        """``k`` samples of each eval prompt (sample ``j`` of prompt ``i`` is at index ``i * k + j``), seeded by
        :func:`eval_seed`."""
        return [
            Sample(
                index=i * k + j,
                prompt=prompt,
                prompt_ids=self.encoder.ids(prompt, where=f"eval prompt {i}"),
                seed=eval_seed(self.run.seed, i, j),
            )
            for i, prompt in enumerate(self.eval_prompts)
            for j in range(k)
        ]

    async def _answer(self, samples: list[Sample], temperature: float, where: str) -> list[Sample]:
        """``samples`` answered at ``temperature`` and scored: played by the agent if the run has one."""
        if self.agent is not None:
            return await self._play_all([(sample, where) for sample in samples], temperature)
        await self._generate(samples, self._sampling(temperature=temperature))
        await self.scorer.score(samples, [where] * len(samples))
        return samples

    def _sampling(self, *, temperature: float) -> SamplingParams:
        rollout = self.rollout
        return SamplingParams(
            max_new_tokens=rollout.max_new_tokens, temperature=temperature, top_p=rollout.top_p, top_k=rollout.top_k
        )

    # -- generation -----------------------------------------------------------------------------------------

    async def _generate(self, samples: list[Sample], params: SamplingParams) -> None:
        """Fill every sample's response; one /generate call per engine per wave. A failed wave (an engine died) is
        sent again once the engines are back, at most :data:`MAX_ATTEMPTS` times; requests cut by a weight update
        (``abort``) are sent again at once (continued with ``--rollout-partial``, else from the start)."""
        pending = list(samples)
        failures = cuts = 0
        while True:
            clients = self._clients()
            shares = [pending[i :: len(clients)] for i in range(len(clients))]
            results = await asyncio.gather(
                *(
                    self._generate_on(client, share, params)
                    for client, share in zip(clients, shares, strict=True)
                    if share
                ),
                return_exceptions=True,
            )
            failed = [exc for exc in results if isinstance(exc, BaseException)]
            still = [s for s in pending if not s.finish_reason]
            if not still:
                return
            if failed:
                failures += 1
                if failures == MAX_ATTEMPTS:
                    raise MilesError(f"{len(still)} samples could not be generated: {failed[:1]}")
                await self.controller.wait_for_engines(self.engine.startup_timeout_s)
            else:
                cuts = 0 if len(still) < len(pending) else cuts + 1
                if cuts == MAX_CUTS:
                    raise MilesError(f"{len(still)} samples were cut {MAX_CUTS} times in a row without finishing")
            pending = still

    def _clients(self) -> list[EngineClient]:
        if self.controller.router_client is not None:
            return [self.controller.router_client]
        clients = self.controller.engine_clients()
        if not clients:
            raise MilesError("no engine is running")
        self._next_engine = (self._next_engine + 1) % len(clients)
        return clients[self._next_engine :] + clients[: self._next_engine]

    async def _generate_on(self, client: EngineClient, share: list[Sample], params: SamplingParams) -> None:
        prompts = [s.prompt_ids + s.response_ids for s in share]  # a cut request continues after its tokens
        per_sample = [_continued(params, s) for s in share]
        extra: dict[str, Any] = {"routing": self.routing} if self.routing is not None else {}  # routing replay
        if self.controller.lora_name is not None:  # LoRA: the trainer's adapter, once one was published
            extra["lora_path"] = self.controller.lora_name
        outputs: list[GenerateOutput | BaseException]
        if client.is_router:  # one request per sample, so that the router can spread them over its engines
            outputs = await asyncio.gather(
                *(client.generate_outputs(ids, p, **extra) for ids, p in zip(prompts, per_sample, strict=True)),
                return_exceptions=True,
            )
        else:
            outputs = await client.generate_outputs(prompts, per_sample, **extra)
        for sample, output in zip(share, outputs, strict=True):
            if not isinstance(output, BaseException):
                self._take(sample, output, client.name)
        failed = [output for output in outputs if isinstance(output, BaseException)]
        if failed:
            raise failed[0]

    def _take(self, sample: Sample, output: GenerateOutput, engine: str) -> None:
        """Add an answer to its sample. A cut one (``abort``) keeps its tokens with ``--rollout-partial`` (when it
        carries their logprobs) and is continued; without it, its sample starts again."""
        if output.aborted:
            if not output.output_ids:
                return  # cut before it produced anything: sent again as it was
            if not (self.rollout.partial and len(output.logprobs) == len(output.output_ids)):
                sample.response_ids, sample.logprobs, sample.segments = [], [], []
                sample.routed_experts = None
                return
        if output.output_ids or not sample.segments:
            sample.segments.extend(_segments(output, engine))
        sample.response_ids = sample.response_ids + output.output_ids
        sample.logprobs = sample.logprobs + output.logprobs
        sample.routed_experts = _routing_continued(sample.routed_experts, output.routed_experts)
        sample.weight_version = output.weight_version
        finish = output.finish_reason
        if output.aborted:
            if len(sample.response_ids) < self.rollout.max_new_tokens:
                return
            finish = "length"  # cut after its last token
        sample.finish_reason = finish
        sample.engine = engine
        # the tokenizer's decode, not the engine's text: rewards see exactly what the trainer trains on
        sample.response = decode_response(self.tokenizer, sample.response_ids)

    # -- agents ---------------------------------------------------------------------------------------------

    async def _play_all(self, samples: list[tuple[Sample, str]], temperature: float) -> list[Sample]:
        """Play every sample with the agent, all at once (each in a session of its own); the samples, each followed
        by the samples of its agent's branches."""
        played = await asyncio.gather(*(self._play(sample, temperature, where) for sample, where in samples))
        return [sample for branches in played for sample in branches]

    async def _play(self, sample: Sample, temperature: float, where: str) -> list[Sample]:
        """One sample: a new session, the agent's conversation, its trajectory and reward (and those of the branches
        the agent forked: samples of their own, sharing the index). A failure to reach the policy plays it again in
        a new session once the engines are back (at most :data:`MAX_ATTEMPTS` times); an agent's own error stops the
        run. The sample takes nothing from a session its agent did not finish."""
        assert self.agent is not None and self.sessions is not None
        failure: BaseException | None = None
        for _ in range(MAX_ATTEMPTS):
            if failure is not None:
                await self.controller.wait_for_engines(self.engine.startup_timeout_s)
            server = self.sessions.pick()
            try:
                engine = self._session_engine()
                session_id, base_url = await self.sessions.create(
                    server,
                    sampling=self._session_sampling(sample, temperature),
                    metadata={},
                    engine_url=engine.url,
                    engine_is_router=engine.is_router,
                )
            except Exception as exc:
                if not is_session_failure(exc):
                    raise
                failure = exc
                continue
            try:
                result = await self.agent.run(
                    base_url=base_url, prompt=sample.prompt.text, metadata=copy.deepcopy(sample.prompt.metadata)
                )
            except Exception as exc:
                with contextlib.suppress(Exception):  # end the session; a server that died took it with it
                    await self.sessions.finish(server, session_id)
                if not is_session_failure(exc):
                    raise MilesError(
                        f"agent {self.agent.name} raised on {describe(sample, where)}: {type(exc).__name__}: {exc}"
                    ) from exc
                failure = exc
                continue
            try:
                trajectories = await self.sessions.finish(server, session_id)
            except Exception as exc:
                if not is_session_failure(exc):
                    raise
                failure = exc
                continue
            return await self._branch_samples(sample, trajectories, result, where)
        raise MilesError(
            f"agent {self.agent.name} could not play {describe(sample, where)} in {MAX_ATTEMPTS} sessions: "
            f"{type(failure).__name__}: {failure}"
        )

    def _session_engine(self) -> EngineClient:
        """The engine the next session generates with (in turn), or the router."""
        if self.controller.router_client is not None:
            return self.controller.router_client
        clients = self.controller.engine_clients()
        if not clients:
            raise MilesError("no engine is running")
        self._next_session_engine = (self._next_session_engine + 1) % len(clients)
        return clients[self._next_session_engine]

    def _session_sampling(self, sample: Sample, temperature: float) -> dict[str, Any]:
        rollout = self.rollout
        return {
            "max_tokens": rollout.max_new_tokens,
            "temperature": temperature,
            "top_p": rollout.top_p,
            "top_k": rollout.top_k,
            "seed": sample.seed % (1 << 62),
        }

    async def _branch_samples(
        self, sample: Sample, trajectories: list[Trajectory], result: Any, where: str
    ) -> list[Sample]:
        """The samples of a played session and its branches (those in which the policy said something), each with
        its reward: one per session when the agent returned a list, else the same for all."""
        if isinstance(result, list | tuple):
            if len(result) != len(trajectories):
                raise MilesError(
                    f"agent {self.agent.name} returned {len(result)} rewards for {describe(sample, where)}, which "
                    f"has {len(trajectories)} sessions (itself and {len(trajectories) - 1} branches): one each"
                )
            rewards = list(result)
        else:
            rewards = [result] * len(trajectories)
        played = [(t, r) for t, r in zip(trajectories, rewards, strict=True) if t.turns]
        if not played:
            raise MilesError(
                f"agent {self.agent.name} finished {describe(sample, where)} without asking the policy anything"
            )
        samples = [sample] + [copy.deepcopy(sample) for _ in played[1:]]
        for branch, (trajectory, reward) in zip(samples, played, strict=True):
            self._take_trajectory(branch, trajectory)
            await self._agent_reward(branch, reward, where)
        return samples

    def _take_trajectory(self, sample: Sample, trajectory: Trajectory) -> None:
        """The session's exact tokens as the sample's: the policy's turns with loss mask 1, the agent's messages 0."""
        sample.prompt_ids = list(trajectory.prompt_ids)
        sample.response_ids = list(trajectory.response_ids)
        sample.logprobs = list(trajectory.logprobs)
        sample.loss_mask = list(trajectory.loss_mask)
        sample.turns = list(trajectory.turns)
        sample.segments = _turn_segments(trajectory)
        sample.transcript = _transcript(self.tokenizer, trajectory)
        self._report_notes(trajectory)
        last = trajectory.turns[-1]
        sample.weight_version, sample.finish_reason, sample.engine = last.weight_version, last.finish_reason, "session"
        sample.response = decode_response(self.tokenizer, trajectory.response_ids[last.start : last.end])

    def _report_notes(self, trajectory: Trajectory) -> None:
        """Each chat-format warning of the run shown once, on the driver's stderr (the session keeps its tokens)."""
        for note in trajectory.notes:
            if note["summary"] not in self.reported_notes:
                self.reported_notes.add(note["summary"])
                print(f"miles: warning: {note['summary']}: {note['detail']}", file=sys.stderr, flush=True)

    async def _agent_reward(self, sample: Sample, result: Any, where: str) -> None:
        """The agent's reward, checked; ``None``: the run's reward scores the last turn."""
        if result is None:
            await self.scorer.score([sample], [where])
            return
        try:
            sample.reward = checked_reward(result)
        except ValueError as exc:
            raise MilesError(
                f"agent {self.agent.name} {exc} on {describe(sample, where)}: an agent returns the sample's reward "
                "(a finite int or float) or None (the run's reward function scores its last turn)"
            ) from None

    # -- rewards --------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Let the reward pool's idle threads end."""
        self.scorer.close()

    @staticmethod
    def _stats(samples: list[Sample], prefix: str) -> dict[str, float]:
        """The step's reward and length statistics, each reward part's mean (``{prefix}/reward/<name>``) and the
        reward failures counted (``reward/errors``, ``reward/timeouts``; ``eval/reward_errors``, ... for an eval)."""
        rewards = [s.reward for s in samples]
        lengths = [len(s.response_ids) for s in samples]
        parts: dict[str, list[float]] = {}
        for sample in samples:
            for name, value in sample.reward_parts.items():
                parts.setdefault(name, []).append(value)
        failures = "reward/" if prefix == "rollout" else f"{prefix}/reward_"
        return {
            f"{prefix}/reward_mean": statistics.fmean(rewards),
            f"{prefix}/reward_std": statistics.pstdev(rewards),
            f"{prefix}/response_length": statistics.fmean(lengths),
            f"{prefix}/samples": float(len(samples)),
            **{f"{prefix}/reward/{name}": statistics.fmean(values) for name, values in parts.items()},
            f"{failures}errors": float(sum(s.reward_errors for s in samples)),
            f"{failures}timeouts": float(sum(s.reward_timeouts for s in samples)),
        }


def _segments(output: GenerateOutput, engine: str) -> list[tuple[int | None, int]]:
    """``(weight version, tokens)`` of an answer: from SGLang's ``meta_info.weight_versions`` spans when an update
    came while the request was held (``retract``), else all of it under ``output.weight_version``."""
    spans = output.meta.get("weight_versions")
    if not isinstance(spans, list) or not spans:
        return [(output.weight_version, len(output.output_ids))]
    try:
        segments = [
            (parse_weight_version(span["version"], engine=engine), span["end"] - span["start"]) for span in spans
        ]
    except (KeyError, TypeError) as exc:
        raise EngineError(f"engine {engine} sent malformed meta_info.weight_versions {spans!r:.200}: {exc}") from None
    if sum(count for _, count in segments) != len(output.output_ids) or any(count < 0 for _, count in segments):
        raise EngineError(
            f"engine {engine}'s weight_versions {spans!r:.200} do not cover its {len(output.output_ids)} tokens"
        )
    return [segment for segment in segments if segment[1] > 0] or [(output.weight_version, 0)]


def _routing_continued(before: RoutedExperts | None, answer: RoutedExperts | None) -> RoutedExperts | None:
    """A sample's routed experts after an answer: the answer covers every token of its request (the prompt, the
    tokens of earlier answers, its own), so the tokens the sample has routing for keep it (what they were generated
    with) and the answer's routing of the tokens after them is appended."""
    if answer is None:
        return before
    if not before:
        return answer
    return before + answer[len(before) :]


def _turn_segments(trajectory: Trajectory) -> list[tuple[int | None, int]]:
    """``(weight version, tokens)`` of a trajectory's response: each turn's tokens under its version, the messages
    appended before a turn under the version of the turn before them (what the policy had seen)."""
    segments: list[tuple[int | None, int]] = []
    end = 0
    for turn in trajectory.turns:
        if turn.start > end:  # messages appended after the previous turn
            segments.append((segments[-1][0] if segments else turn.weight_version, turn.start - end))
        segments.append((turn.weight_version, turn.end - turn.start))
        end = turn.end
    return segments


def _transcript(tokenizer: Any, trajectory: Trajectory) -> list[dict[str, Any]]:
    """The trajectory's response as spans of the policy's turns and of the agent's messages, each decoded token by
    token with its special tokens (a role marker is part of what the policy read)."""
    spans, end = [], 0
    ids = trajectory.response_ids
    for turn in trajectory.turns:
        if turn.start > end:
            spans.append(("agent", ids[end : turn.start]))
        spans.append(("policy", ids[turn.start : turn.end]))
        end = turn.end
    return [
        {"source": source, "text": "".join(_token_text(tokenizer, token) for token in span), "tokens": len(span)}
        for source, span in spans
    ]


def _token_text(tokenizer: Any, token: int) -> str:
    try:
        return tokenizer.decode([token], skip_special_tokens=False)
    except TypeError:  # a tokenizer without the keyword
        return tokenizer.decode([token])


def _continued(params: SamplingParams, sample: Sample) -> SamplingParams:
    """A sample's request: its own seed, and (a continued one) the tokens it still may generate and a seed of its
    own for the rest."""
    seed = sample.seed
    done = len(sample.response_ids)
    if not done:
        return dataclasses.replace(params, sampling_seed=seed)
    return dataclasses.replace(
        params, max_new_tokens=params.max_new_tokens - done, sampling_seed=(seed * 1009 + done) % (1 << 62)
    )


def decode_response(tokenizer: Any, ids: list[int]) -> str:
    """The text a reward function sees: the generated ids decoded without special tokens (no ``<eos>``, pad or
    bos), otherwise as generated (whitespace kept)."""
    return tokenizer.decode(ids, skip_special_tokens=True)
