"""The post-lowering pipeline: graph edits that need to know which backend runs each region
(layouts between regions, hoisting of parameter-only work, the side-stream schedule), and the
rewrites of squeeze-and-excitation glue into this package's kernels."""
