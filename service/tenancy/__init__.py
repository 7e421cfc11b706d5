"""The tenancy room: who a request is and what it may name. Users and their limits (`users`), the paths a spec
may read and write, resolved and checked in one place (`access`), a user's uploads and the storage they take
(`uploads`), resource quotas (`quota`, pure), where trackers may log (`trackers`), the Tinker API's saved state and
which of it a caller may name (`tinker_paths`), and those rules applied to a request before the manager queues it
(`requests`)."""
