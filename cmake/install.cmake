# Install rules: filled in by the build work.
