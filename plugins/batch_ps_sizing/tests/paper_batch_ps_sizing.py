"""The paper's models as specs, shared by this plugin's tests."""

from __future__ import annotations

from tunekit.plugins.batch_ps_sizing import model as zou

# The paper's AlexNet (96-256-384-384-256 filters), with torchvision's paddings
# so that a 224 input gives Table 2's 55x55 first map.
PAPER_ALEXNET = zou.CnnSpec(
    input_shape=(224, 224, 3),
    features=(
        zou.FeatureLayer("conv", F=11, S=4, P=2, K=96, name="conv1"),
        zou.FeatureLayer("pool", F=3, S=2, name="pool1"),
        zou.FeatureLayer("conv", F=5, S=1, P=2, K=256, name="conv2"),
        zou.FeatureLayer("pool", F=3, S=2, name="pool2"),
        zou.FeatureLayer("conv", F=3, S=1, P=1, K=384, name="conv3"),
        zou.FeatureLayer("conv", F=3, S=1, P=1, K=384, name="conv4"),
        zou.FeatureLayer("conv", F=3, S=1, P=1, K=256, name="conv5"),
        zou.FeatureLayer("pool", F=3, S=2, name="pool5"),
    ),
    fc_widths=(9216, 4096, 4096, 1000),
)
