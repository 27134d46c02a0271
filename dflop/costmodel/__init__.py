"""Cost models fitted on profiles: predict time and memory of stages for given shapes."""
