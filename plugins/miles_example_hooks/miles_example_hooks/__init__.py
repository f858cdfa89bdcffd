"""Example third-party Miles plugin implementing hooks through the ``miles.plugins`` entry-point group."""
