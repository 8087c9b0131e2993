"""The TensorBoard bridge, read back with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
from support.e2e import batch, wait_for

from layertap import Client, Summary

pytest.importorskip("tensorboard")
from PIL import Image  # pillow is a tensorboard-test helper only
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from layertap._tensorboard import FollowOptions, TensorBoardBridge, feature_grid, follow

pytestmark = pytest.mark.e2e

LAYERS = ("layer1", "layer4")
SELECTOR = "re:^layer[14]$"


class _Traffic:
    """Live passes from a background thread, as a served model gets them."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        seed = 0
        while not self._stop.is_set():
            seed += 1
            self._client.infer(batch(2, seed))
            self._stop.wait(0.01)

    def __enter__(self) -> _Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _run(srv, logdir, passes: int, *, drift: bool = False,
         images: list[tuple[str, int, int]] | None = None) -> list[tuple[Summary, int]]:
    got: list[tuple[Summary, int]] = []
    images = [] if images is None else images
    with Client(f"127.0.0.1:{srv.port}", timeout=60) as client, _Traffic(client):
        if drift:
            client.set_baseline("layer4", passes=3, window=2)
            assert wait_for(lambda: any(d.state == "ready" for d in client.drift("layer4")), 30)
        bridge = TensorBoardBridge(logdir)
        try:
            follow(client, bridge, FollowOptions(SELECTOR, images=("conv1",), image_every=2, passes=passes,
                                                 drift_interval=0.0),
                   on_summary=lambda s, step: got.append((s, step)),
                   on_image=lambda layer, pass_index, step: images.append((layer, pass_index, step)))
        finally:
            bridge.close()
    return got


def _accumulator(logdir) -> EventAccumulator:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0, "images": 0})
    acc.Reload()
    return acc


def test_event_files_hold_what_the_client_received(make_server, tmp_path):
    written: list[tuple[str, int, int]] = []
    got = _run(make_server(), tmp_path, passes=4, drift=True, images=written)
    assert {s.layer for s, _ in got} == set(LAYERS) and len(got) == 8
    acc = _accumulator(tmp_path)
    tags = acc.Tags()
    for s, step in got:
        assert step == (s.step if s.step is not None else s.pass_index)  # a fresh logdir: the server's count
        m, mm, z, nf, h = (s.results[k] for k in ("moments", "minmax", "zero_fraction", "nonfinite", "histogram"))
        expected = {"mean": m.mean, "std": m.std, "min": mm.min, "max": mm.max, "zero_fraction": z.fraction,
                    "nan_count": nf.nan_count, "inf_count": nf.inf_count}
        for name, value in expected.items():
            (event,) = [e for e in acc.Scalars(f"{s.layer}/{name}") if e.step == step]
            assert event.value == float(np.float32(value)), (s.layer, name)  # simple_value is a float32
        (hist,) = [e.histogram_value for e in acc.Histograms(f"{s.layer}/histogram") if e.step == step]
        assert list(hist.bucket) == [float(c) for c in h.counts]
        assert list(hist.bucket_limit[:-1]) == list(h.edges) and hist.bucket_limit[-1] > 1e300
        assert hist.num == h.sample_size == sum(h.counts)
        assert (hist.min, hist.max) == (mm.min, mm.max)
    # Drift scores of the layer with a ready baseline, at steps of the passes written.
    drift_tags = [t for t in tags["scalars"] if t.startswith("drift/")]
    assert set(drift_tags) == {f"drift/layer4/{m}" for m in ("psi", "js", "wasserstein", "mean_shift")}
    steps = {step for _, step in got}
    for tag in drift_tags:
        events = acc.Scalars(tag)
        assert events and all(e.step in steps and np.isfinite(e.value) and e.value >= 0 for e in events)
    # Feature maps of conv1 (16 channels of 32x32): a 4x4 grid, each tile scaled to its own range.
    images = acc.Images("conv1/feature_maps")
    assert len(images) == 2  # after passes 1 and 3 of 4, image_every=2
    # Each from the first live pass after its trigger's summaries, labelled with that pass's own step.
    passes = sorted({s.pass_index for s, _ in got})
    assert [layer for layer, _, _ in written] == ["conv1", "conv1"]
    assert [im.step for im in images] == [step for _, _, step in written]
    for (_, pass_index, step), trigger in zip(written, (passes[0], passes[2])):
        assert step == pass_index > trigger
    for im in images:
        assert (im.width, im.height) == (4 * 33 - 1, 4 * 33 - 1)
        pixels = np.asarray(Image.open(io.BytesIO(im.encoded_image_string)).convert("RGB"))
        assert pixels.shape == (im.height, im.width, 3)
        tiles = [pixels[r * 33 : r * 33 + 32, c * 33 : c * 33 + 32, 0] for r in range(4) for c in range(4)]
        assert all(t.min() == 0 and t.max() == 255 for t in tiles)


def test_steps_continue_after_a_server_restart(make_server, tmp_path):
    images: list[tuple[str, int, int]] = []
    first = _run(make_server(), tmp_path, passes=3, images=images)
    # An image from a pass after the last summarized one carries that later pass's step.
    last = max([step for _, step in first] + [step for _, _, step in images])
    second = _run(make_server(), tmp_path, passes=2)  # a new server: its pass count starts again
    assert min(step for _, step in second) == last + 1
    assert [step for _, step in second] == sorted(step for _, step in second)
    acc = _accumulator(tmp_path)
    # Nothing was purged as "out of order": both runs' points are there, in step order.
    for layer in LAYERS:
        steps = [e.step for e in acc.Scalars(f"{layer}/mean")]
        assert steps == sorted({step for s, step in first + second if s.layer == layer})
        assert len(steps) == 5


def test_feature_grid_scales_each_channel_to_its_own_range():
    maps = np.stack([np.arange(6.0).reshape(2, 3) * (i + 1) - i for i in range(3)])
    grid = feature_grid(maps)
    assert grid.shape == (2 * 3 - 1, 2 * 4 - 1, 3)
    expected = np.round(np.arange(6.0).reshape(2, 3) / 5 * 255).astype(np.uint8)
    for r, c in ((0, 0), (0, 1), (1, 0)):
        assert (grid[r * 3 : r * 3 + 2, c * 4 : c * 4 + 3, 1] == expected).all()
    assert (grid[3:, 4:] == 0).all()  # the unused fourth tile stays black


def test_a_traffic_pause_skips_the_image_not_the_summary(make_server, tmp_path, capsys):
    """With --images, the pass's summaries are written first; a capture that sees no further pass is skipped."""
    from layertap.cli import main

    srv = make_server()

    def one_pass() -> None:
        with Client(f"127.0.0.1:{srv.port}") as c:
            assert wait_for(lambda: c.stats().subscribers > 0, 10)
            c.infer(batch(1, seed=5))

    sender = threading.Thread(target=one_pass)
    sender.start()
    assert main(["tensorboard", str(srv.port), "layer1", "--logdir", str(tmp_path), "--images", "conv1",
                 "--image-every", "1", "--image-timeout", "0.5", "--duration", "4", "--timeout", "30"]) == 0
    sender.join(10)
    out = capsys.readouterr().out
    assert out.endswith(", 1 image(s) skipped: no pass in time\n")
    acc = _accumulator(tmp_path)
    assert "conv1/feature_maps" not in acc.Tags()["images"]
    (mean,) = acc.Scalars("layer1/mean")
    assert f": last step {mean.step}, 1 image" in out
