from .dataset import PAD_ID, XCDataset, train_test_split
from .xc_format import XCFormatError, load_xc_file, save_xc_file
from .synthetic import make_synthetic
