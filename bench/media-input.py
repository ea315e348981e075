#!/usr/bin/env python3
"""Records with an image each, for bench/media.sh and bench/media-cpu.sh: N records in WORK/in-N.jsonl,
each naming its own 20 KB file under WORK/img (a PNG signature, then random bytes; files made by
an earlier, smaller size are reused)."""
import json, os, sys

n, work = int(sys.argv[1]), sys.argv[2]
os.makedirs(f"{work}/img", exist_ok=True)
with open(f"{work}/in-{n}.jsonl", "w") as f:
    for i in range(n):
        path = f"{work}/img/{i}.png"
        if not os.path.exists(path):
            with open(path, "wb") as img:
                img.write(b"\x89PNG\r\n\x1a\n" + os.urandom(20_000 - 8))
        f.write(json.dumps({"id": f"r{i}", "prompt": f"What is in picture {i}?", "image": path}) + "\n")
