import io

import numpy as np
import pytest

from tokenflow_ray.tokenizer.training.config import DataSettings
from tokenflow_ray.tokenizer.training.data import ImageDecoder, build_dataset
from tokenflow_ray.tokenizer.training.datasets import write_generated


def _png(side=24, seed=0) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def write_image_folder(folder, n_good: int) -> int:
    """n_good PNGs plus three corrupt files (truncated PNG, random bytes, text named .jpg); returns #corrupt."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_good):
        (folder / f"img{i:04d}.png").write_bytes(_png(seed=i))
    (folder / "truncated.png").write_bytes(_png(seed=999)[:40])
    (folder / "noise.png").write_bytes(np.random.default_rng(1).bytes(500))
    (folder / "notes.jpg").write_text("not an image")
    return 3


def test_decoder_crops_normalises_and_flags_corrupt_rows():
    dec = ImageDecoder(image_size=16, crop_scale_min=0.8, hflip=True, max_pixels=40 * 40, seed=0)
    out = dec({"bytes": np.array([_png(), b"garbage", _png(side=64)], dtype=object)})
    assert out["image"].shape == (3, 3, 16, 16) and out["image"].dtype == np.float32
    assert out["valid"].tolist() == [True, False, False]  # 64 x 64 is over max_pixels: counted as corrupt
    assert -1.0 <= out["image"][0].min() and out["image"][0].max() <= 1.0
    assert not out["image"][1].any()


def test_generated_datasets_are_parquet_and_reused(tmp_path):
    import pyarrow.parquet as pq

    a = write_generated("shapes", tmp_path, num_images=40, side=32, seed=3, rows_per_file=16)
    assert len(list(a.glob("*.parquet"))) == 3
    assert pq.read_table(a).num_rows == 40
    assert write_generated("shapes", tmp_path, num_images=40, side=32, seed=3) == a
    with pytest.raises(ValueError, match="unknown generated dataset"):
        write_generated("faces", tmp_path, 4)


@pytest.mark.timeout(120)
def test_folder_pipeline_skips_and_counts_corrupt_files(ray_session, tmp_path):
    folder = tmp_path / "imgs"
    corrupt = write_image_folder(folder, n_good=20)
    ds = build_dataset(DataSettings(source="images", path=str(folder), image_size=16, batch_size=8), str(tmp_path))
    valid = np.concatenate([b["valid"] for b in ds.iter_batches(batch_size=8, batch_format="numpy")])
    assert (len(valid), int((~valid).sum())) == (20 + corrupt, corrupt)
    assert set(ds.columns()) == {"image", "valid"}  # the path column never reaches iter_torch_batches
