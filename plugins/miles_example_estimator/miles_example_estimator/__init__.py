"""An example third-party advantage estimator for Miles: OPO's length-weighted baseline (see :mod:`.opo`)."""
