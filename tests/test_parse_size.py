"""parse_size (patches/formats/units.py), the memory size a user writes: decimal and binary units in any case,
decimals rounded down to a whole byte, and everything else refused in one line that names the accepted forms."""
import pytest

from patches.formats.units import parse_size

FORMS = ("give a positive number of bytes, or one with KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers "
         "of 1024), upper or lower case, e.g. 80GB or 1.5GiB")


@pytest.mark.parametrize("text, size", [
    ("512", 512),
    ("80GB", 80_000_000_000),
    ("80gb", 80_000_000_000),
    ("1KB", 1_000),
    ("3MB", 3_000_000),
    ("2TB", 2_000_000_000_000),
    ("1.1TB", 1_100_000_000_000),
    ("2.01KB", 2_010),  # exact: 2.01 * 1000 in floats is 2009.9999999999998
    ("2.07GB", 2_070_000_000),  # and 2.07 * 1000**3 is 2069999999.9999998
    ("0.5KB", 500),
    ("1KiB", 1_024),
    ("1kib", 1_024),
    ("2MiB", 2_097_152),
    ("1.5GiB", 1_610_612_736),  # 1.5 * 1073741824
    ("1.3GiB", 1_395_864_371),  # 1.3 * 1073741824 = 1395864371.2, down to a whole byte
    ("1TiB", 1_099_511_627_776),
    (" 24 GiB ", 25_769_803_776),
    ("1.5", 1),
])
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text, why", [
    ("", "is not a size"),
    ("GB", "is not a size"),
    ("80 gigs", "is not a size"),
    ("80G", "is not a size"),
    ("80B", "is not a size"),
    ("1e9", "is not a size"),
    (".5GB", "is not a size"),
    ("1.2.3GB", "is not a size"),
    ("+5GB", "is not a size"),
    ("80GB80", "is not a size"),
    ("nan", "is not a size"),
    ("\u0661\u0662", "is not a size"),  # Arabic-Indic digits, which int() would take
    ("1\u212aB", "is not a size"),  # the Kelvin sign, which an ignore-case match would take for a K
    ("-1GB", "is negative"),
    ("-0", "is negative"),
    ("0", "is zero"),
    ("0.0GiB", "is zero"),
    ("0.0001KB", "is under one byte"),
])
def test_what_is_not_a_size_is_one_line_naming_the_forms(text, why):
    with pytest.raises(ValueError) as error:
        parse_size(text)
    assert str(error.value) == f"size {text!r} {why}: {FORMS}"
    assert "\n" not in str(error.value)


def test_a_newline_in_the_text_stays_out_of_the_one_line():
    with pytest.raises(ValueError) as error:
        parse_size("80\nGB")
    assert str(error.value) == f"size '80\\nGB' is not a size: {FORMS}"
