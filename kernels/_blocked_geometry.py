"""The geometry of a conv on blocked tensors: one int64 array the wrapper fills (conv_nchwc)
and the kernels of the blocked conv family read (_direct_blocked, _depthwise_blocked), so one
argument is unboxed per call and both kernels name its fields the same way.

    N, CB, BI, H, W       images, input blocks, channels per input block, input rows, columns
    KH, KW, SH, SW, DH, DW  kernel, strides, dilations
    PT, PL                pads at the top and left (the bottom and right follow from OH, OW)
    MB, OH, OW            output blocks, output rows, columns
    G, CBG, MBG           groups, input and output blocks per group
    FB, PW                register tile: output blocks (columns) and pixels (rows)
    OGG                   filter groups of FB blocks per group
    COL_A, COL_B          output columns whose every horizontal tap is inside the row
    CHUNK                 input blocks per K chunk (weights past half of L2 are cut)
    ROWS                  output rows per work item
    RESIDUAL, ACT         epilogue: kernels/epilogue.py's residual, the activation's kind
    ROW_A, ROW_B          output rows whose every vertical tap is inside the image
    PAD                   depthwise: 1 if a work item pads its input rows in one copy, 0 if
                          its tiles read x, and only tiles at an edge read a padded copy, 2
                          if nothing is copied (edge pixels one at a time)
    XBS, YBS              direct: pixels from one input (output) block to the next, H W (OH
                          OW) for whole tensors; more when the conv runs on a run of rows of a
                          larger tensor (the depth-first block's bands, _inverted_residual_blocked)
    ROW0                  depthwise: the output row y's rows start at (0 for a whole tensor; a
                          band's first row when y is the band's scratch)
    YMB                   direct: blocks from one image of y to the next: MB, or more when y
                          is a run of channel blocks of a larger tensor (a concatenation's
                          part: ConvConcat, FireModule)
    PARTS                 direct, a 1x1 conv run as one row (G = 1): runs of pixels per filter
                          group, each a work item (0 or 1: the row whole)
    HALF                  direct: 1 if each group's last input block holds at most BI / 2
                          channels (24, 40, 72 ... at 16 lanes): the row tiles run its taps on
                          half the channel loop, the rest of the block being zeros (edge
                          columns and single pixels run the whole loop); else 0
    WN                    direct: floats from one image's packed weights to the next: 0 when
                          every image shares them, their size when each image has its own (a
                          squeeze-excitation gate folded into the conv after it:
                          kernels/squeeze_excite.py gated_weights)
"""

import numpy as np

(N, CB, BI, H, W, KH, KW, SH, SW, DH, DW, PT, PL, MB, OH, OW, G, CBG, MBG, FB, PW, OGG, COL_A,
 COL_B, CHUNK, ROWS, RESIDUAL, ACT, ROW_A, ROW_B, PAD, XBS, YBS, ROW0, YMB, PARTS, HALF, WN,
 N_GEO) = range(39)  # fmt: skip


def pack(**fields) -> np.ndarray:
    """The geometry array with the named fields set (pack(N=1, CB=4, ...)), the others 0."""
    g = np.zeros(N_GEO, np.int64)
    for name, value in fields.items():
        g[globals()[name]] = value
    return g
