"""Property-based fuzzing (Hypothesis) of the kubelet plugin's DRA service over real gRPC.

Generated valid claims (1-3 of the node's whole GPUs and MIG devices, with or without an opaque
config: Exclusive or TimeSlicing GpuConfig, MigDeviceConfig), a quarter of them with their
allocation mutated, prepared in concurrent calls, some claims sharing a device: every claim that
is valid and whose devices no other claim wants is prepared; a device is never held by two
claims, and of claims that want one device and are sent together exactly one gets it; a prepared
claim's answer and CDI spec name exactly its allocated devices.

Also generated and mutated NodePrepareResources / NodeUnprepareResources requests (v1 and v1beta1:
empty, huge, duplicate UIDs, unknown and replaced claims, claims whose allocation has mutated
fields, odd strings, oversized messages, mutated wire bytes) go over a unix socket to the plugin
layer with the GPU driver on a simulated node. Checked: every claim of a request gets an answer
(devices or its own error, never an "internal error"), the server keeps serving, each call is
answered within a bound, and a claim that failed leaves no CDI spec and no checkpoint record.

Request bytes mutated on the wire: the status each gets is the one its bytes call for (decoded
here with the same message type): an answer, RESOURCE_EXHAUSTED over gRPC's 4 MiB, or the
undecodable request's UNKNOWN naming protobuf's DecodeError; any other status (a handler's
unhandled exception: UNKNOWN, INTERNAL) fails.

CI: the "ci" Hypothesis profile (fixed seed); the longer run: HYPOTHESIS_PROFILE=nightly (see
tests/mutation.py). What the examples reached is printed at the end of the run.
"""

from __future__ import annotations

import asyncio
import copy
import random
import shutil
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from dra_gpu.kubeletplugin._proto import dra_v1_pb2 as v1_pb
from dra_gpu.kubeletplugin._proto import dra_v1_pb2_grpc as v1_grpc
from dra_gpu.kubeletplugin._proto import dra_v1beta1_pb2 as v1beta1_pb
from dra_gpu.kubeletplugin._proto import dra_v1beta1_pb2_grpc as v1beta1_grpc
from dra_gpu.kubeletplugin.claims import ClaimFetcher
from dra_gpu.kubeletplugin.helper import serve_unix
from dra_gpu.kubeletplugin.metrics import PluginMetrics
from dra_gpu.kubeletplugin.node_service import DraV1beta1Service, DraV1Service, NodeService
from dra_gpu.plugin.checkpoint import COMPLETED
from dra_gpu.plugin.gpu_driver import GpuDriver
from plugin.conftest import DRIVER, NODE, PluginCore, claim, gpu_names, mig_names
from tests.controller.generators import like
from tests.mutation import fuzz_settings, paths, reach, reaching, replace_at

FUZZ = fuzz_settings(40)
BOUND_S = 10.0  # per call, a batch of up to a few hundred claims included
PB = {"v1": (v1_pb, v1_grpc), "v1beta1": (v1beta1_pb, v1beta1_grpc)}

odd_text = st.text(max_size=30) | st.sampled_from(
    ["", "\x00", "../../../etc/passwd", "a" * 300, "ü\u202e\ufeff", "default", "claim-", " "]
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | odd_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)


class Fuzz:
    """The plugin's DRA service on a unix socket, one for all examples (one event loop)."""

    def __init__(self, core: PluginCore) -> None:
        self.core = core
        self.loop = asyncio.new_event_loop()
        self.sock_dir = Path(tempfile.mkdtemp(prefix="dra", dir="/tmp"))  # unix paths < 108 bytes
        self.tried: Counter[str] = Counter()
        g, m = gpu_names(core), mig_names(core)
        self.valid = [
            claim(str(uuid.uuid4()), [g[0]], name="one-gpu"),
            claim(str(uuid.uuid4()), [g[1], g[2]], name="two-gpus", requests=["gpus/a", "other"]),
            claim(str(uuid.uuid4()), [m[0]], name="one-mig"),
            claim(str(uuid.uuid4()), [g[0]], name="same-gpu"),  # conflicts with one-gpu
            claim(str(uuid.uuid4()), [g[3]], name="other-node", node="node-b"),
            claim(str(uuid.uuid4()), ["gpu-9999-99-00-0"], name="unknown-device"),
        ]
        for c in self.valid:
            core.add(c)
        self.migs = set(m)
        self.server: Any = None
        self.channel: Any = None
        self.loop.run_until_complete(self._start())

    async def _start(self) -> None:
        driver = GpuDriver(DRIVER, NODE, self.core.preparer.planner.catalog, self.core.preparer)
        node = NodeService(driver, ClaimFetcher(self.core.claims), PluginMetrics())
        self.dra = self.sock_dir / "dra.sock"
        self.server = await serve_unix(
            self.dra,
            [
                (v1_grpc.add_DRAPluginServicer_to_server, DraV1Service(node)),
                (v1beta1_grpc.add_DRAPluginServicer_to_server, DraV1beta1Service(node)),
            ],
        )
        self.channel = grpc.aio.insecure_channel(f"unix://{self.dra}")

    def close(self) -> None:
        async def stop() -> None:
            await self.channel.close()
            await self.server.stop(None)

        self.loop.run_until_complete(stop())
        self.loop.close()
        shutil.rmtree(self.sock_dir, ignore_errors=True)

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    # -- what a call must leave behind ------------------------------------------------------------

    async def call(self, version: str, op: str, refs: list[tuple[str, str, str]]) -> Any:
        pb, stubs = PB[version]
        claims = [pb.Claim(namespace=n, uid=u, name=c) for n, u, c in refs]
        stub = stubs.DRAPluginStub(self.channel)
        before = {r.uid for r in self.core.checkpoint.records()}
        start = time.monotonic()
        if op == "prepare":
            request = pb.NodePrepareResourcesRequest(claims=claims)
            resp = await stub.NodePrepareResources(request, timeout=BOUND_S)
        else:
            request = pb.NodeUnprepareResourcesRequest(claims=claims)
            resp = await stub.NodeUnprepareResources(request, timeout=BOUND_S)
        assert time.monotonic() - start < BOUND_S
        self.tried[f"{op} {version} claims"] += len(refs)
        assert set(resp.claims) == {u for _, u, _ in refs}, "a claim of the request got no answer"
        specs = self.core.cdi.owned()
        for uid, answer in resp.claims.items():
            assert not answer.error.startswith("internal error"), answer.error
            record = self.core.checkpoint.get(uid)
            if op == "unprepare":
                if not answer.error:
                    assert record is None and uid not in specs
                continue
            if answer.error:
                self.tried["prepare errors"] += 1
                assert not answer.devices, "a failed claim got devices too"
                if uid not in before:
                    assert record is None, f"failed claim {uid} left a checkpoint record"
                    assert uid not in specs, f"failed claim {uid} left a CDI spec"
            else:
                self.tried["prepared"] += 1
                assert answer.devices, "a prepared claim without devices"
                assert record is not None and record.state == COMPLETED
                assert uid in specs
                self.assert_names_its_devices(uid, answer)
        return resp

    def assert_names_its_devices(self, uid: str, answer: Any) -> None:
        """A prepared claim's answer and CDI spec name exactly the devices its allocation gives it
        on this node (the claim as the store holds it: the one with this UID)."""
        (stored,) = [c for c in self.core.claims.values() if c["metadata"]["uid"] == uid]
        results = stored["status"]["allocation"]["devices"]["results"]
        mine = {
            (r["pool"], r["device"])
            for r in results
            if isinstance(r, dict) and r.get("driver") == DRIVER and r.get("pool") == NODE
        }
        assert {(d.pool_name, d.device_name) for d in answer.devices} == mine
        spec = self.core.cdi.read(uid)
        assert spec is not None
        names = {f"{uid}-{device}" for _, device in mine}
        assert {d["name"] for d in spec["devices"]} == names, (spec["devices"], names)
        ids = {i for d in answer.devices for i in d.cdi_device_ids}
        assert ids == {f"{spec['kind']}={n}" for n in names}

    async def reset(self) -> None:
        """Unprepare everything the example prepared; nothing may be left."""
        refs = [(r.namespace, r.uid, r.name) for r in self.core.checkpoint.records()]
        if refs:
            await self.call("v1", "unprepare", refs)
        assert self.core.checkpoint.records() == []
        assert self.core.cdi.owned() == {}
        leftovers = [p.name for p in self.core.cdi.dir.glob(".*")] if self.core.cdi.dir.is_dir() else []
        assert leftovers == [], f"temporary files left in the CDI dir: {leftovers}"
        # still serving
        await v1_grpc.DRAPluginStub(self.channel).NodePrepareResources(
            v1_pb.NodePrepareResourcesRequest(), timeout=BOUND_S
        )


@st.composite
def mutant(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    """A valid claim with one to three fields of its metadata or allocation replaced."""
    obj = copy.deepcopy(base)
    obj["metadata"]["uid"] = str(uuid.UUID(int=draw(st.integers(0, 2**128 - 1))))
    obj["metadata"]["name"] = "mutant-" + obj["metadata"]["uid"][:8]
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from([p for p in paths(obj["status"]) if p] or [("allocation",)]))
        target = obj["status"]
        for key in where[:-1]:
            target = target[key]
        target[where[-1]] = draw(json_values)
    return obj


REF_KINDS = ["known", "unknown", "replaced", "mutant", "duplicate", "renamed duplicate", "huge batch"]


@st.composite
def requests(draw: st.DrawFn, fuzz: Fuzz) -> tuple[list[dict[str, Any]], list[tuple[str, str, list[Any]]]]:
    """Mutant claims to add to the store, and a sequence of (version, operation, refs) calls."""
    mutants = [draw(mutant(draw(st.sampled_from(fuzz.valid[:3])))) for _ in range(draw(st.integers(0, 2)))]
    calls = []
    for _ in range(draw(st.integers(1, 4))):
        refs: list[tuple[str, str, str]] = []
        for _ in range(draw(st.integers(0, 6))):
            kind = draw(st.sampled_from(REF_KINDS))
            fuzz.tried[f"ref {kind}"] += 1
            if kind == "known" or (kind == "mutant" and not mutants):
                c = draw(st.sampled_from(fuzz.valid))["metadata"]
                refs.append((c["namespace"], c["uid"], c["name"]))
            elif kind == "mutant":
                c = draw(st.sampled_from(mutants))["metadata"]
                refs.append((c["namespace"], c["uid"], c["name"]))
            elif kind == "unknown":
                refs.append((draw(odd_text), draw(odd_text), draw(odd_text)))
            elif kind == "replaced":  # the claim's name with a UID it no longer has
                c = draw(st.sampled_from(fuzz.valid))["metadata"]
                refs.append((c["namespace"], draw(odd_text), c["name"]))
            elif refs and kind == "duplicate":
                refs.append(draw(st.sampled_from(refs)))
            elif refs and kind == "renamed duplicate":  # one UID, two names, either first
                ns, uid, _ = draw(st.sampled_from(refs))
                refs.insert(draw(st.integers(0, len(refs))), (ns, uid, draw(odd_text)))
            elif kind == "huge batch":
                n = draw(st.integers(50, 300))
                refs += [("ns", str(uuid.uuid4()), f"c{i}") for i in range(n)]
        calls.append((draw(st.sampled_from(list(PB))), draw(st.sampled_from(["prepare", "unprepare"])), refs))
    return mutants, calls


def test_prepare_and_unprepare_answer_every_claim(core: PluginCore) -> None:
    fuzz = Fuzz(core)
    try:

        @FUZZ
        @given(st.data())
        def one(data: st.DataObject) -> None:
            mutants, calls = data.draw(requests(fuzz))
            prepared_before = fuzz.tried["prepared"]
            for m in mutants:
                core.add(m)
            try:
                for version, op, refs in calls:
                    fuzz.tried[f"{op} {version} calls"] += 1
                    fuzz.run(fuzz.call(version, op, refs))
            finally:
                fuzz.run(fuzz.reset())
                for m in mutants:
                    core.claims.pop((m["metadata"]["namespace"], m["metadata"]["name"]), None)
            reach("a claim prepared" if fuzz.tried["prepared"] > prepared_before else "none prepared")

        with reaching(0.07, "a claim prepared"):
            one()
    finally:
        fuzz.close()
    print(f"\ngRPC fuzz (requests): {dict(sorted(fuzz.tried.items()))}")


def test_mutated_wire_bytes_and_oversized_messages(core: PluginCore) -> None:
    """Valid requests with bytes flipped, cut or inserted, sent raw; and messages over gRPC's
    4 MiB limit. Each gets a response or a gRPC status, and the server keeps serving."""
    fuzz = Fuzz(core)
    outcomes: Counter[str] = Counter()
    try:

        @FUZZ
        @given(st.data())
        def one(data: st.DataObject) -> None:
            version = data.draw(st.sampled_from(list(PB)))
            op = data.draw(st.sampled_from(["NodePrepareResources", "NodeUnprepareResources"]))
            pb, _ = PB[version]
            picked = data.draw(st.lists(st.sampled_from(fuzz.valid), max_size=4))
            claims = [pb.Claim(**{k: c["metadata"][k] for k in ("namespace", "uid", "name")}) for c in picked]
            prepare = op == "NodePrepareResources"
            request_type = pb.NodePrepareResourcesRequest if prepare else pb.NodeUnprepareResourcesRequest
            wire = bytearray(request_type(claims=claims).SerializeToString())
            rng = random.Random(data.draw(st.integers(0, 2**32)))
            for _ in range(data.draw(st.integers(0, 4))):  # 0: the valid request
                what = rng.choice(["flip", "cut", "insert"])
                at = rng.randrange(len(wire) + 1)
                if what == "flip" and at < len(wire):
                    wire[at] ^= 1 << rng.randrange(8)
                elif what == "cut":
                    del wire[at : at + rng.randrange(1, 8)]
                else:
                    wire[at:at] = rng.randbytes(rng.randrange(1, 8))
            if data.draw(st.integers(0, 9)) == 0:
                wire += b"\x0a" + b"\xff\xff\xff\x02" + b"x" * (5 << 20)  # a 5 MiB claim field
            service = "k8s.io.kubelet.pkg.apis.dra." + version + ".DRAPlugin"
            raw = fuzz.channel.unary_unary(
                f"/{service}/{op}", request_serializer=lambda b: b, response_deserializer=lambda b: b
            )

            expected = expected_outcome(bytes(wire), request_type)

            async def send() -> None:
                start = time.monotonic()
                try:
                    await raw(bytes(wire), timeout=BOUND_S)
                    got, details = "answered", ""
                except grpc.aio.AioRpcError as exc:
                    got, details = exc.code().name, exc.details() or ""
                assert time.monotonic() - start < BOUND_S
                assert got == expected, (got, details, expected)
                if got == "UNKNOWN":  # grpc's own deserializer, not a handler's exception
                    name = request_type.DESCRIPTOR.full_name
                    assert details.startswith(f"{UNDECODABLE}: Error parsing message with type '{name}'"), (
                        details
                    )
                outcomes[got] += 1
                reach(got)

            try:
                fuzz.run(send())
            finally:
                fuzz.run(fuzz.reset())

        with reaching(0.1, "answered"):  # decoded and handled, not refused at the wire
            one()
    finally:
        fuzz.close()
    assert outcomes
    print(f"\ngRPC fuzz (wire bytes, {sum(outcomes.values())} sent): {dict(sorted(outcomes.items()))}")


MAX_MESSAGE = 4 << 20  # gRPC's default limit on a received message
UNDECODABLE = "Unexpected <class 'google.protobuf.message.DecodeError'>"


def expected_outcome(wire: bytes, request_type: Any) -> str:
    """The status the server must give these request bytes: over the message limit
    RESOURCE_EXHAUSTED; bytes that do not decode as the request type UNKNOWN (grpc-python's answer
    to its deserializer's DecodeError; checked to name it); else an answer."""
    if len(wire) > MAX_MESSAGE:
        return "RESOURCE_EXHAUSTED"
    try:
        request_type.FromString(wire)
    except DecodeError:
        return "UNKNOWN"
    return "answered"


def test_wire_fuzz_fails_on_a_handler_crash(core: PluginCore, monkeypatch: Any) -> None:
    """The wire check itself: a handler that raises on a decodable request gets UNKNOWN from
    grpc, which is not the answer its bytes call for."""

    async def crash(*args: Any) -> Any:
        raise RuntimeError("handler crash")

    monkeypatch.setattr(DraV1Service, "NodePrepareResources", crash)
    fuzz = Fuzz(core)
    try:
        raw = fuzz.channel.unary_unary(
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        wire = v1_pb.NodePrepareResourcesRequest().SerializeToString()
        assert expected_outcome(wire, v1_pb.NodePrepareResourcesRequest) == "answered"

        async def send() -> str:
            try:
                await raw(wire, timeout=BOUND_S)
                return "answered"
            except grpc.aio.AioRpcError as exc:
                return exc.code().name

        assert fuzz.run(send()) == "UNKNOWN"
    finally:
        fuzz.close()


@st.composite
def valid_claims(
    draw: st.DrawFn, fuzz: Fuzz, pool: list[str], mutate: bool = True
) -> tuple[dict[str, Any], list[str], bool]:
    """(claim, the devices it was allocated, mutated): 1-3 devices of `pool`, each request with
    or without an opaque config fitting its kind; a quarter with one to three values of the
    allocation replaced."""
    devices = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))
    uid = str(uuid.UUID(int=draw(st.integers(0, 2**128 - 1))))
    requests = [f"r{i}" for i in range(len(devices))]
    config = []
    for r, d in zip(requests, devices, strict=True):
        strategies = ["Exclusive"] if d in fuzz.migs else ["Exclusive", "TimeSlicing"]
        if draw(st.booleans()):
            kind = "MigDeviceConfig" if d in fuzz.migs else "GpuConfig"
            params = {"apiVersion": "gpu.dra-gpu.io/v1alpha1", "kind": kind,
                      "sharing": {"strategy": draw(st.sampled_from(strategies))}}  # fmt: skip
            config.append({"requests": [r], "opaque": {"driver": DRIVER, "parameters": params}})
    c = claim(uid, devices, name="gen-" + uid, requests=requests, config=config)
    if not mutate or draw(st.integers(0, 3)):
        return c, devices, False
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from([p for p in paths(c["status"]) if p]))
        old: Any = c["status"]
        for key in where:
            old = old[key]
        replace_at(c["status"], where, draw(like(old)) if draw(st.booleans()) else draw(json_values))
    return c, devices, True


def test_generated_claims_prepared_concurrently(core: PluginCore) -> None:
    """Batches of generated claims (some wanting one device) in 1-3 concurrent calls: a valid claim
    whose devices no other claim of the batch wants is prepared; no device is held by two claims;
    of valid claims that want one device (and nothing else another wants), exactly one gets it and
    the others are refused for it; a prepared claim's answer and spec name exactly its devices
    (Fuzz.call)."""
    fuzz = Fuzz(core)
    # a small pool so that claims of a batch often want the same device
    pool = [*gpu_names(core)[:3], *mig_names(core)[:3]]
    try:

        @FUZZ
        @given(st.data())
        def one(data: st.DataObject) -> None:
            if data.draw(st.integers(0, 2)):
                claims = valid_claims(fuzz, pool)
            else:  # valid claims of one device each, all the same one
                claims = valid_claims(fuzz, [data.draw(st.sampled_from(pool))], mutate=False)
            batch = data.draw(
                st.lists(claims, min_size=1, max_size=4, unique_by=lambda c: c[0]["metadata"]["uid"])
            )
            for c, _, _ in batch:
                core.add(c)
            try:
                wanted = Counter(d for _, devices, _ in batch for d in devices)
                refs = [
                    (c["metadata"]["namespace"], c["metadata"]["uid"], c["metadata"]["name"])
                    for c, _, _ in batch
                ]
                split = data.draw(st.integers(1, 3))
                calls = [refs[i::split] for i in range(split) if refs[i::split]]
                versions = [data.draw(st.sampled_from(list(PB))) for _ in calls]

                async def send() -> list[Any]:
                    sent = (fuzz.call(v, "prepare", r) for v, r in zip(versions, calls, strict=True))
                    return list(await asyncio.gather(*sent))

                answers = {uid: a for resp in fuzz.run(send()) for uid, a in resp.claims.items()}
                holders: dict[str, list[str]] = {}
                for uid, a in answers.items():
                    for d in {d.device_name for d in a.devices}:
                        holders.setdefault(d, []).append(uid)
                for d, uids in holders.items():
                    assert len(uids) == 1, f"device {d} held by claims {uids}"
                for c, devices, mutated in batch:
                    error = answers[c["metadata"]["uid"]].error
                    alone = all(wanted[d] == 1 for d in devices)
                    if not mutated and alone:
                        assert not error, f"a valid claim wanting devices no other wants failed: {error}"
                    reach(
                        f"{'mutated' if mutated else 'valid'} claim, "
                        f"{'devices its own' if alone else 'a device wanted by another'}: "
                        f"{'refused' if error else 'prepared'}"
                    )
                for d, n in wanted.items():
                    rivals = [(c, devices, m) for c, devices, m in batch if d in devices]
                    if n < 2 or any(m or any(wanted[x] > 1 for x in devs if x != d) for _, devs, m in rivals):
                        continue
                    assert len(holders.get(d, [])) == 1, (
                        d,
                        [answers[c["metadata"]["uid"]].error for c, _, _ in rivals],
                    )
                    for c, _, _ in rivals:
                        if c["metadata"]["uid"] not in holders[d]:
                            assert "refusing to hand it to two claims" in answers[c["metadata"]["uid"]].error
                    reach("batch: claims wanting one device, exactly one got it")
            finally:
                fuzz.run(fuzz.reset())
                for c, _, _ in batch:
                    core.claims.pop((c["metadata"]["namespace"], c["metadata"]["name"]), None)

        with reaching(
            0.15,
            "valid claim, devices its own: prepared",
            "valid claim, a device wanted by another: prepared",
        ):
            one()
    finally:
        fuzz.close()


def test_one_uid_named_twice_gets_one_clear_error(core: PluginCore) -> None:
    """Found by the fuzzer: an unknown name before the claim's real name under one UID gave an
    answer with both an error and devices (the answer is keyed by UID)."""
    fuzz = Fuzz(core)
    try:
        good = fuzz.valid[0]["metadata"]
        for refs in (
            [("default", good["uid"], "not-it"), ("default", good["uid"], good["name"])],
            [("default", good["uid"], good["name"]), ("default", good["uid"], "not-it")],
        ):
            resp = fuzz.run(fuzz.call("v1", "prepare", refs))
            assert "named twice in one request" in resp.claims[good["uid"]].error
        same = [("default", good["uid"], good["name"])] * 3
        resp = fuzz.run(fuzz.call("v1beta1", "prepare", same))
        assert resp.claims[good["uid"]].error == "" and len(resp.claims[good["uid"]].devices) == 1
        fuzz.run(fuzz.reset())
    finally:
        fuzz.close()
