"""Reinforcement learning from your own loop, with the official Tinker SDK against a trainyard service: each round
the LoRA client's current weights sample completions of a prompt, a reward scores them here (the share of their
bytes that are lowercase letters), and an importance-sampling step (the samples' own logprobs, advantages = reward
minus the round's mean) moves the policy toward the higher-scored ones. The mean reward rises.

    python examples/tiny_model.py /tmp/tiny-llama
    trainyard serve --base-model tiny-llama=/tmp/tiny-llama &
    python examples/tinker_rl.py --base-model tiny-llama            # the admin's token from ~/.trainyard/token
"""

from __future__ import annotations

from tinker_common import api_key, service_parser, training_client

PROMPT = list(b"Say it: ")


def reward(tokens: list[int]) -> float:
    """The share of the completion's bytes that are lowercase ASCII letters (26 of 256 ids: rare at the start)."""
    return sum(ord("a") <= t <= ord("z") for t in tokens) / max(len(tokens), 1)


def run(url: str, key: str, base_model: str, rounds: int = 12, samples: int = 16, max_tokens: int = 8,
        rank: int = 8, lr: float = 3e-2, parallel: dict | None = None, seed: int = 0) -> list[float]:
    """`rounds` rounds of sample, score, step; each round's mean reward (of the samples it stepped on)."""
    import tinker

    training = training_client(url, key, base_model, rank, parallel)
    prompt = tinker.types.ModelInput.from_ints(PROMPT)
    means = []
    for r in range(rounds):
        sampler = training.save_weights_and_get_sampling_client()  # the current weights, no file written
        params = tinker.types.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[], seed=seed + r)
        sequences = sampler.sample(prompt, samples, params).result().sequences
        rewards = [reward(s.tokens) for s in sequences]
        mean = sum(rewards) / len(rewards)
        data = []
        for s, score in zip(sequences, rewards, strict=True):
            tokens = PROMPT + s.tokens
            scored = [0.0] * (len(PROMPT) - 1)  # the prompt's positions carry no advantage
            data.append(tinker.types.Datum(
                model_input=tinker.types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": scored + list(s.logprobs),
                                "advantages": scored + [score - mean] * len(s.tokens)}))
        training.forward_backward(data, "importance_sampling")
        training.optim_step(tinker.types.AdamParams(learning_rate=lr)).result()
        means.append(mean)
        print(f"round {r + 1:3d}  mean reward {mean:.3f}", flush=True)
    return means


if __name__ == "__main__":
    parser = service_parser(__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    run(args.url, api_key(args.token), args.base_model, args.rounds, parallel=args.parallel)
