"""The staging bucket's layout: offsets aligned to each dtype, chunks that fit, an overflow that names the tensor;
and the config check that refuses rdt without Ray-hosted engines. No Ray needed."""

from __future__ import annotations

import asyncio
import itertools

import miles_plugins_rdt.protocol as protocol_module
import pytest
import torch
from miles_plugins_rdt.protocol import RdtProtocol
from miles_plugins_rdt.staging import bucket_layout, byte_range, in_waves, plan_routes, split_into_lanes

from miles_core.bounds import MAX_LANES, machine_cpus, machine_memory_mib
from miles_core.config.build import build_config
from miles_core.errors import ConfigError, MilesError
from miles_core.plugin_manager import MilesPluginManager
from miles_core.weight_transfer.staging_layout import StagingLayout, StagingLayoutError, StagingOverflowError
from tests.conftest import run_miles


def test_offsets_are_aligned_to_each_dtype_and_views_round_trip() -> None:
    tensors = [
        ("a.bf16", torch.randn(3).to(torch.bfloat16)),
        ("b.f32", torch.randn(2, 3)),
        ("c.i8", torch.tensor([1, 2, 3], dtype=torch.int8)),
        ("d.i64", torch.arange(5)),
        ("e.f64", torch.randn(2, dtype=torch.float64)),
    ]
    layout = bucket_layout(tensors, capacity=1024)
    assert [s.offset for s in layout.tensors] == [0, 8, 32, 40, 80]  # 6 -> 8 (f32), 35 -> 40 (i64), 80 (f64)
    assert all(s.offset % t.element_size() == 0 for s, (_, t) in zip(layout.tensors, tensors, strict=True))
    bucket = torch.zeros(1024, dtype=torch.uint8)
    for target, (_, tensor) in zip(layout.views(bucket).values(), tensors, strict=True):
        target.copy_(tensor)
    wire = StagingLayout.from_wire(layout.to_wire())  # as the engine reads it from the switch request
    for view, (_, tensor) in zip(wire.views(bucket).values(), tensors, strict=True):
        assert view.dtype == tensor.dtype and torch.equal(view, tensor)


def test_a_tensor_larger_than_the_bucket_is_an_error_naming_it() -> None:
    big = [("model.small", torch.zeros(4)), ("model.layers.0.mlp.up_proj.weight", torch.zeros(300))]
    with pytest.raises(
        StagingOverflowError,
        match=r"model\.layers\.0\.mlp\.up_proj\.weight \(float32, shape \(300,\)"
        r".* raise the rdt setting staging_bucket_mb",
    ):
        bucket_layout(big, capacity=1024)


def test_consecutive_buckets_continue_the_layout() -> None:
    first = bucket_layout([(f"w{i}", torch.zeros(60)) for i in range(2)], capacity=512)
    second = bucket_layout(
        [("h", torch.zeros(3, dtype=torch.float16)), ("w", torch.zeros(1))], capacity=512, start=first.size
    )
    whole = StagingLayout.concat([first, second], alignment=1)  # the version the engines switch to
    assert [s.offset for s in whole.tensors] == [0, 240, 480, 488] and whole.size == 492
    with pytest.raises(StagingOverflowError, match=r"w2 .* at offset 480"):
        bucket_layout([("w2", torch.zeros(60))], capacity=512, start=480)


def test_views_refuse_a_layout_outside_the_bucket() -> None:
    layout = bucket_layout([("x", torch.zeros(8))], capacity=64)
    with pytest.raises(StagingLayoutError, match=r"needs 32 bytes .* the staging buffer has 16"):
        layout.views(torch.zeros(16, dtype=torch.uint8))


def test_routes_spread_engines_over_sending_ranks() -> None:
    assert plan_routes(2, ["engine-0", "engine-1", "engine-2"]) == {"engine-0": 0, "engine-1": 1, "engine-2": 0}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"transport": "tcp"}, "rdt setting transport = 'tcp': expected 'nixl' or 'gloo'"),
        ({"staging_bucket_mb": 0}, "rdt setting staging_bucket_mb = 0: expected a number above 0"),
        (
            {"staging_bucket_mb": True},
            "staging_bucket_mb = True: expected a number above 0 and of at most 1048576 (a boolean is not a number)",
        ),
        ({"staging_bucket_mb": float("inf")}, "staging_bucket_mb = inf: expected a number above 0"),
        ({"receive_lanes": 0}, "rdt setting receive_lanes = 0: expected a whole number of at least 1"),
        ({"receive_lanes": 1.5}, "rdt setting receive_lanes = 1.5: expected a whole number of at least 1"),
        ({"receive_lanes": "2"}, "rdt setting receive_lanes = '2': expected a whole number of at least 1"),
        (
            {"receive_lanes": True},
            "receive_lanes = True: expected a whole number of at least 1 and of at most 64 (a boolean is not",
        ),
        ({"timeout_s": 0}, "rdt setting timeout_s = 0: expected a number above 0"),
        ({"timeout_s": "soon"}, "rdt setting timeout_s = 'soon': expected a number above 0"),
        ({"lanes": 2}, "rdt has no setting 'lanes'; rdt's settings: transport, staging_bucket_mb, receive_lanes"),
    ],
)
def test_bad_settings_are_refused(settings: dict, message: str) -> None:
    """Its declared model refuses them (a boolean lane count, an infinite bucket and any timeout passed before)."""
    with pytest.raises(ConfigError) as refused:
        RdtProtocol(**settings)
    assert message in str(refused.value)
    assert "do not fit the protocol 'rdt' (miles_plugins_rdt.protocol:RdtProtocol)" in str(refused.value)


def test_auto_checks_rdts_settings_when_the_config_is_built_wherever_the_engines_run() -> None:
    """Settings auto keeps for rdt are checked against its model though this run (local engines) never picks rdt."""
    with pytest.raises(ConfigError) as refused:
        build_config(
            MilesPluginManager.load(), overrides={"weight_transfer.settings": {"rdt": {"receive_lanes": True}}}
        )
    assert str(refused.value).startswith(
        'weight_transfer.settings.rdt (--weight-transfer-settings) {"receive_lanes": true} do not fit the protocol '
        "'rdt' (miles_plugins_rdt.protocol:RdtProtocol): rdt setting receive_lanes = True: expected a whole number"
    )


def test_settings_are_typed_attributes(caplog: pytest.LogCaptureFixture) -> None:
    protocol = RdtProtocol(transport="gloo", staging_bucket_mb=1, receive_lanes=4)
    assert (protocol.settings.transport, protocol.settings.staging_bucket_mb) == ("gloo", 1.0)
    assert (protocol.lanes, protocol.capacity) == (1, 1 << 20)  # gloo: one lane, whatever receive_lanes says
    assert [record.getMessage() for record in caplog.records if record.name == protocol_module.__name__] == [
        "rdt: the setting receive_lanes = 4 is not used: transport gloo reads with one lane (one sender, whole "
        "chunks); remove it, or use transport nixl"
    ]
    caplog.clear()
    assert RdtProtocol(transport="nixl", receive_lanes=4).lanes == 4 and RdtProtocol(transport="gloo").lanes == 1
    assert [record for record in caplog.records if record.name == protocol_module.__name__] == []


def test_selecting_rdt_without_ray_hosted_engines_is_an_explicit_error() -> None:
    result = run_miles("config", "show", "--update-weight-transfer-mode", "rdt")
    assert result.returncode != 0
    assert "needs engines hosted in Ray actors" in result.stderr and "--run-worker-provider ray" in result.stderr
    result = run_miles(
        "config",
        "show",
        "--update-weight-transfer-mode",
        "rdt",
        "--run-worker-provider",
        "ray",
        "--weight-transfer-settings",
        '{"transport": "tcp"}',
    )
    assert result.returncode == 2 and "rdt setting transport = 'tcp': expected 'nixl' or 'gloo'" in result.stderr
    assert "Traceback" not in result.stderr
    accepted = run_miles("config", "show", "--update-weight-transfer-mode", "rdt", "--run-worker-provider", "ray")
    assert accepted.returncode == 0, accepted.stderr


def test_receive_lanes_beyond_the_hard_cap_are_refused_by_miles_config_show() -> None:
    """The issue's case: 100000 lanes (Ray actors) per engine rank started workers without end; refused when the
    config is built, naming the field, the value and the bound, before any worker starts."""
    result = run_miles(
        "config",
        "show",
        "--json",
        "--update-weight-transfer-mode",
        "rdt",
        "--run-worker-provider",
        "ray",
        "--weight-transfer-settings",
        "{receive_lanes: 100000}",
    )
    assert result.returncode == 2 and result.stdout == ""
    assert (
        "rdt setting receive_lanes = 100000: expected a whole number of at least 1 and of at most 64; receive_lanes: "
    ) in result.stderr
    assert "Traceback" not in result.stderr


def test_receive_lanes_beyond_four_per_cpu_of_this_machine_are_refused() -> None:
    """Under the hard cap, the machine's bound: more than 4 lanes per CPU only wait for a CPU."""
    bound = protocol_module.RECEIVE_LANES_PER_CPU * machine_cpus()
    overrides = {"run.worker_provider": "ray", "weight_transfer.mode": "rdt"}
    if bound + 1 <= MAX_LANES:
        with pytest.raises(ConfigError) as refused:
            build_config(
                MilesPluginManager.load(),
                overrides={**overrides, "weight_transfer.settings": {"receive_lanes": bound + 1}},
            )
        assert f"rdt setting receive_lanes = {bound + 1}: " in str(refused.value)
        assert f"more than 4 receive lanes per CPU of this machine ({machine_cpus()} CPUs: at most {bound})" in str(
            refused.value
        )
    accepted = min(bound, MAX_LANES)
    config = build_config(
        MilesPluginManager.load(), overrides={**overrides, "weight_transfer.settings": {"receive_lanes": accepted}}
    )
    assert config.weight_transfer.settings == {"receive_lanes": accepted}


def test_a_staging_bucket_beyond_a_quarter_of_this_machines_memory_is_refused() -> None:
    """Two buckets per engine rank must fit in half the physical memory; 1 TiB is the cap on any machine."""
    too_big = machine_memory_mib() // 4 + 1
    with pytest.raises(ConfigError) as refused:
        RdtProtocol(staging_bucket_mb=too_big)
    assert f"rdt setting staging_bucket_mb = {too_big}: " in str(refused.value)
    assert f"2 staging buckets of {too_big} MiB would take more than half of this machine's" in str(refused.value)
    with pytest.raises(ConfigError, match="staging_bucket_mb = 2000000: expected a number above 0 and of at most"):
        RdtProtocol(staging_bucket_mb=2_000_000)


def test_connect_from_a_process_outside_ray_is_an_explicit_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol_module.ray, "is_initialized", lambda: False)  # as in a process that never joined
    with pytest.raises(MilesError, match="needs engines hosted in Ray actors"):
        asyncio.run(RdtProtocol().connect([]))


def test_lanes_share_a_chunk_evenly_and_cover_every_byte_once() -> None:
    tensors = [
        ("a", torch.arange(100_000, dtype=torch.float32)),
        ("b", torch.arange(7, dtype=torch.int8)),
        ("c", torch.randn(300, 500).to(torch.bfloat16)),
        ("d", torch.arange(3, dtype=torch.int64)),
    ]
    layout = bucket_layout(tensors, capacity=1 << 22)
    bucket = torch.zeros(1 << 22, dtype=torch.uint8)
    lanes = split_into_lanes(layout.tensors, 3, granule=4096)
    total = sum(slot.nbytes for slot in layout.tensors)
    sizes = [sum(piece.nbytes for piece in lane) for lane in lanes]
    assert sum(sizes) == total and max(sizes) - min(sizes) <= 2 * 4096
    for lane in lanes:  # each lane moves its pieces, as a receiver would, into the bucket
        for piece in lane:
            source = byte_range(tensors[piece.tensor][1], piece.start, piece.nbytes)
            bucket[piece.offset : piece.offset + piece.nbytes].copy_(source)
    for (_, tensor), view in zip(tensors, layout.views(bucket).values(), strict=True):
        assert torch.equal(view, tensor)


def test_a_chunk_smaller_than_the_granule_goes_to_one_lane() -> None:
    slots = bucket_layout([("x", torch.ones(10))], capacity=1024).tensors
    assert [len(lane) for lane in split_into_lanes(slots, 2)] == [1, 0]
    with pytest.raises(MilesError, match="at least one receive lane"):
        split_into_lanes(slots, 0)


def test_waves_hold_whole_buckets_of_at_least_the_wave_size_in_order() -> None:
    buckets = [[(f"b{i}.w", torch.full((n,), float(i)))] for i, n in enumerate([10, 30, 5, 5, 40, 1])]  # float32
    waves = list(in_waves(iter(buckets), min_bytes=35 * 4))
    assert [[name for name, _ in wave] for wave in waves] == [["b0.w", "b1.w"], ["b2.w", "b3.w", "b4.w"], ["b5.w"]]
    assert all(sum(t.numel() * 4 for _, t in wave) >= 35 * 4 for wave in waves[:-1])
    assert [len(wave) for wave in in_waves(iter(buckets), min_bytes=0)] == [1] * 6  # each bucket is a wave
    assert list(in_waves(iter([[], []]), min_bytes=0)) == []  # empty buckets make no wave


def test_waves_hold_contiguous_tensors() -> None:
    transposed = torch.arange(12.0).reshape(3, 4).t()
    ((name, tensor),) = next(in_waves(iter([[("w", transposed)]]), min_bytes=0))
    assert name == "w" and tensor.is_contiguous() and torch.equal(tensor, transposed)


def test_holders_shares_are_placed_one_after_another_and_a_version_too_large_names_the_setting() -> None:
    from miles_plugins_rdt.holders import _lane_cuts

    shares = [
        [("h0.a", torch.randn(3)), ("h0.b", torch.arange(3, dtype=torch.int8))],
        [("h1.a", torch.randn(2, 2).to(torch.bfloat16))],
        [],
        [("h3.a", torch.arange(4))],
    ]
    layouts = [StagingLayout.of(share, alignment=1) for share in shares]
    bases, placed = RdtProtocol(staging_bucket_mb=1)._placed(layouts)
    assert bases == [0, 64, 128, 128]  # each share from a 64-byte boundary; the empty one takes no room
    assert [(e.name, e.offset) for e in placed.tensors] == [("h0.a", 0), ("h0.b", 12), ("h1.a", 64), ("h3.a", 128)]
    bucket = torch.zeros(placed.size, dtype=torch.uint8)
    for share, layout, base in zip(shares, layouts, bases, strict=True):  # each holder's bytes where it sends them
        holder_buffer = torch.zeros(layout.size, dtype=torch.uint8)
        for (_, tensor), view in zip(share, layout.views(holder_buffer).values(), strict=True):
            view.copy_(tensor)
        bucket[base : base + layout.size] = holder_buffer
    views = placed.views(bucket)
    assert all(torch.equal(views[name], tensor) for share in shares for name, tensor in share)
    big = [StagingLayout.of([("w", torch.zeros(300_000))], alignment=1)] * 2  # 2.3 MiB in a 1 MiB bucket
    with pytest.raises(MilesError, match="raise that setting to at least 3"):
        RdtProtocol(staging_bucket_mb=1)._placed(big)
    for size, lanes in [(1, 2), (4096, 2), (10_000, 3), (1 << 20, 4)]:
        cuts = _lane_cuts(size, lanes)
        assert cuts[0][0] == 0 and cuts[-1][1] == size and len(cuts) <= lanes
        assert all(end == start for (_, end), (start, _) in itertools.pairwise(cuts))  # contiguous
