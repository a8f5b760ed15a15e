"""What a run tells its observers: the typed events the ranks send (`events`), the split of
the wall time (`goodput`) and the console's lines (`console`)."""
