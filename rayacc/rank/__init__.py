"""A rank's assembly: its strategy, model, optimizer, schedule and accumulation step, built from
the run's config (`build.build_rank`)."""
