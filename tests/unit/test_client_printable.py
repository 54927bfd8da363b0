from pdserve.app.commands.client import printable


def test_control_characters_are_escaped_but_text_survives():
    assert printable("a\x00b\x1b[1m\tc\nd\x7fé") == "a\\x00b\\x1b[1m\tc\nd\\x7fé"
    assert printable("plain text") == "plain text"
