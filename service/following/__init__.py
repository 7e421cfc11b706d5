"""The following room: the jobs the service follows in Ray and the follower thread that polls them
(`live_jobs`), how far a poll has read and writing a report to the store (`follow`), and making the store true to
Ray when the service starts (`reconcile`)."""
