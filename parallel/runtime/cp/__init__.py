"""Context parallelism (`parallel.cp`): each sequence split over the ranks of a cp group inside a replica.

`chunks` owns which tokens a rank holds (head-tail balanced: rank i of cp holds chunks i and 2cp-1-i of 2cp) and the
slicing of a micro-batch to them; `ring` owns causal attention over the group (key/value blocks passed round a
ring, partial results merged by their log-sum-exp). The loss and the gradients need nothing of their own: each
rank's loss is its tokens' share of the step's (the scale is the global token count), and the gradients are summed
over the replica's dp x cp ranks (`parallel.plan.layout`).
"""
