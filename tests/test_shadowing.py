"""shadow(): an attribute set on one instance and put back exactly as the instance had it."""
from patches.profiler.shadowing import shadow


class Owner:
    def method(self):
        return "class"


def test_undo_shows_the_class_attribute_again():
    owner, other = Owner(), Owner()
    undo = shadow(owner, "method", lambda: "shadowed")
    assert owner.method() == "shadowed"
    assert other.method() == "class"  # the class and every other instance untouched
    undo()
    assert "method" not in vars(owner)
    assert owner.method() == "class"


def test_undo_puts_back_the_instance_own_value():
    owner = Owner()
    own = owner.method = lambda: "own"
    undo = shadow(owner, "method", lambda: "shadowed")
    assert owner.method() == "shadowed"
    undo()
    assert vars(owner)["method"] is own


def test_nested_shadows_undone_in_reverse_order():
    owner = Owner()
    first = shadow(owner, "method", lambda: "first")
    second = shadow(owner, "method", lambda: "second")
    second()
    assert owner.method() == "first"
    first()
    assert "method" not in vars(owner)
