"""Results that travel: bundles made by `checks share`, read by `checks import` and `checks validate` as
untrusted input."""
