"""The admission room: which waiting job starts next (`queue`, the pure policy) and the admission thread's body
that reserves its placement group and starts its coordinator (`admit`)."""
