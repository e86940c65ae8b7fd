#!/usr/bin/env python3
"""Reference dequantization for tests/engine/test_ggml_types.cpp: two random blocks of every
type the engine dequantizes, decoded by gguf-py (the ggml project's own Python reader), written
to quant_blocks.json as {type: {"id", "hex", "values"}}. Scale fields are set to finite f16
values so the expected floats are finite.

Run: /tmp/golden-venv/bin/python tests/engine/golden/make_quant_golden.py   (gguf 0.19.0, numpy)
"""
import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T, GGML_QUANT_SIZES
from gguf.quants import dequantize

# byte offsets of the f16 scale fields of each block type
SCALES = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
          T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}


def main():
    rng = np.random.default_rng(1234)
    out = {}
    for t, offs in SCALES.items():
        block, size = GGML_QUANT_SIZES[t]
        raw = rng.integers(0, 256, size=(2, size), dtype=np.uint8)
        for b in range(2):
            for o in offs:
                s = np.float16(rng.uniform(-0.1, 0.1) if o == offs[0] else rng.uniform(0, 0.05))
                raw[b, o:o + 2] = np.frombuffer(s.tobytes(), dtype=np.uint8)
        vals = dequantize(raw.reshape(-1), t).astype(np.float32).reshape(-1)
        assert vals.size == 2 * block and np.all(np.isfinite(vals))
        out[t.name] = {"id": int(t), "hex": raw.tobytes().hex(), "values": vals.tolist()}
    halves = np.array([0.0, -0.0, 1.0, -2.5, 65504.0, 6.1035e-05, 5.96e-08, 1e-7, np.inf, -np.inf],
                      dtype=np.float16)
    out["F16"] = {"id": int(T.F16), "hex": halves.tobytes().hex(),
                  "values": [float(x) if np.isfinite(x) else str(x) for x in halves.astype(np.float32)]}
    f = np.array([1.0, -3.140625, 1e-20, 3e38, 0.0], dtype=np.float32)
    bf = (f.view(np.uint32) >> 16).astype(np.uint16)
    out["BF16"] = {"id": int(T.BF16), "hex": bf.tobytes().hex(),
                   "values": (bf.astype(np.uint32) << 16).view(np.float32).tolist()}
    path = Path(__file__).resolve().parent / "quant_blocks.json"
    path.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print("wrote", path, path.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
