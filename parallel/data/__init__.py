"""The data room: datasets and the layout-independent sampler (`datasets`), the tokenized directory format
(`token_dir`), `trainyard prepare` (`prepare`) and chat records (`chat`). May import `parallel.config`,
`parallel.seeds` and `parallel.plan`.
"""
