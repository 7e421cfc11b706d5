"""Whether and how a job changes size (Ray Train v2's scaling_policy/): `scaling` (the `ScalingPolicy` protocol,
`FixedScaling`, `ElasticScaling` and the largest size an elastic job may take) and `resize_desk` (`ResizeDesk`, the
one place a resize is accepted, whoever asks). The resize itself is the recovery's (`actors.actions.recovery`)."""
