"""The studies behind the results page: each module is the logic and the options of one
``benchmarks/<name>.py`` script (convergence, fading, auto_freeze, ...)."""
