"""Supervised learning from your own loop, with the official Tinker SDK against a trainyard service: a LoRA
training client learns the bytes of examples/corpus.txt (next-token cross-entropy), then samples from what it learnt.

    python examples/tiny_model.py /tmp/tiny-llama
    trainyard serve --base-model tiny-llama=/tmp/tiny-llama &
    python examples/tinker_sl.py --base-model tiny-llama            # the admin's token from ~/.trainyard/token

Prints each step's mean loss per token; `--parallel '{"dp": 2}'` places the client at another layout.
"""

from __future__ import annotations

from pathlib import Path

from tinker_common import api_key, service_parser, training_client

CORPUS = Path(__file__).with_name("corpus.txt")


def batches(seq_len: int, batch: int):
    """Windows of the corpus's bytes, `batch` at a time, round and round."""
    data = list(CORPUS.read_bytes())
    starts = list(range(0, len(data) - seq_len - 1, seq_len))
    i = 0
    while True:
        yield [data[s:s + seq_len + 1] for s in (starts[(i + j) % len(starts)] for j in range(batch))]
        i += batch


def run(url: str, key: str, base_model: str, steps: int = 20, rank: int = 8, lr: float = 2e-2,
        seq_len: int = 32, batch: int = 4, parallel: dict | None = None) -> list[float]:
    """`steps` rounds of forward_backward and optim_step; each round's mean loss per token (before its step)."""
    import tinker

    training = training_client(url, key, base_model, rank, parallel)
    losses = []
    for _, windows in zip(range(steps), batches(seq_len, batch), strict=False):
        data = [tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(w[:-1]),
                                   loss_fn_inputs={"target_tokens": w[1:], "weights": [1.0] * seq_len})
                for w in windows]
        out = training.forward_backward(data, "cross_entropy")  # gradients accumulate until the step
        training.optim_step(tinker.types.AdamParams(learning_rate=lr)).result()
        losses.append(out.result().metrics["loss:sum"] / (seq_len * batch))
        print(f"step {len(losses):3d}  loss {losses[-1]:.3f}", flush=True)
    sampler = training.save_weights_and_get_sampling_client()
    prompt = tinker.types.ModelInput.from_ints(list(b"The "))
    greedy = tinker.types.SamplingParams(max_tokens=24, temperature=0.0, stop=[])
    tokens = sampler.sample(prompt, 1, greedy).result().sequences[0].tokens
    print("sample:", repr(bytes(t for t in tokens if t < 256).decode("utf-8", "replace")))
    return losses


if __name__ == "__main__":
    parser = service_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=2e-2)
    args = parser.parse_args()
    run(args.url, api_key(args.token), args.base_model, args.steps, lr=args.lr, parallel=args.parallel)
